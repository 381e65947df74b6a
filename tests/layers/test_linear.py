"""Fused linear layers: forward equals nn.Linear, weight_loader shards, tensor-parallel slices."""

import pytest
import torch
from torch import nn

from fxrewrite.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear


def test_qkv_shards_gqa():
    q, k, v = nn.Linear(16, 8, bias=True), nn.Linear(16, 4, bias=True), nn.Linear(16, 4, bias=True)
    layer = QKVParallelLinear(16, head_size=2, total_num_heads=4, total_num_kv_heads=2, bias=True)
    for sid, lin in (("q", q), ("k", k), ("v", v)):
        layer.weight.weight_loader(layer.weight, lin.weight.data, sid)
        layer.bias.weight_loader(layer.bias, lin.bias.data, sid)
    x = torch.randn(5, 16)
    out_q, out_k, out_v = layer(x).split(layer.output_sizes, dim=-1)
    for out, lin in ((out_q, q), (out_k, k), (out_v, v)):
        torch.testing.assert_close(out, lin(x))  # one matmul: not bitwise


def test_qkv_tensor_parallel_rank_slices():
    full = torch.arange(12 * 4, dtype=torch.float32).view(12, 4)  # q 8 rows (4 heads x 2), k 2, v 2
    layer = QKVParallelLinear(4, head_size=2, total_num_heads=4, total_num_kv_heads=1, tp_size=2, tp_rank=1)
    layer.weight.weight_loader(layer.weight, full)
    assert layer.q_size == 4 and layer.kv_size == 2 and layer.num_kv_head_replicas == 2
    torch.testing.assert_close(layer.weight[:4], full[4:8])
    torch.testing.assert_close(layer.weight[4:6], full[8:10])
    torch.testing.assert_close(layer.weight[6:8], full[10:12])


def test_merged_column_shards_and_tp():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    layer = MergedColumnParallelLinear(4, [6, 6], tp_size=2, tp_rank=1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    torch.testing.assert_close(layer.weight, torch.cat([gate[3:], up[3:]]))
    with pytest.raises(ValueError, match="loaded_shard_id"):
        layer.weight.weight_loader(layer.weight, up, 2)


def test_column_and_row_tp_slices():
    w = torch.randn(6, 4)
    col = ColumnParallelLinear(4, 6, tp_size=2, tp_rank=1)
    col.weight.weight_loader(col.weight, w)
    torch.testing.assert_close(col.weight, w[3:])
    row = RowParallelLinear(4, 6, tp_size=2, tp_rank=0)
    row.weight.weight_loader(row.weight, w)
    torch.testing.assert_close(row.weight, w[:, :2])


def test_errors_name_the_value():
    with pytest.raises(ValueError, match="output_size=5"):
        ColumnParallelLinear(4, 5, tp_size=2)
    layer = ColumnParallelLinear(4, 6)
    with pytest.raises(ValueError, match=r"\(6, 3\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(6, 3))


def test_meta_construction_and_grad():
    assert ColumnParallelLinear(4, 6, device="meta").weight.is_meta
    layer = MergedColumnParallelLinear(4, [3, 3], bias=True)
    layer(torch.randn(2, 4)).sum().backward()
    assert layer.weight.grad is not None and layer.bias.grad is not None
