"""FP8 linear layers: checkpoint weights + block scales load through the layer's own (fused, sharded)
weight loader; dequantized they equal the dequantized checkpoint tensors, sliced as the layer slices."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxrewrite.kernels.fp8_gemm import fp8_block_gemm_ref, per_token_group_quant_fp8_ref
from fxrewrite.layers.fp8_linear import (
    SCALE_NAME,
    as_linear_base,
    convert_linear_to_fp8,
    dequantize_fp8_layer,
    quantize_fp8_layer,
    quantize_weight_fp8,
)
from fxrewrite.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

BLOCK = (128, 128)


def _checkpoint(rows: int, cols: int):
    """(fp8 weight, checkpoint scale [ceil(rows/128), ceil(cols/128)], its dequantized float32 value)."""
    q, s = quantize_weight_fp8(torch.randn(rows, cols), BLOCK)
    deq = q.float() * s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return q, s, deq


def _load(layer, shards):
    for sid, (q, s, _) in shards.items():
        layer.weight.weight_loader(layer.weight, q, sid)
        getattr(layer, SCALE_NAME).weight_loader(getattr(layer, SCALE_NAME), s, sid)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_qkv_with_partial_blocks_equals_dequantized_shards(tp_rank):
    # head_dim 64, 4 q heads, 1 kv head: k/v are 64 rows (half a block), replicated over 2 ranks;
    # each rank's q shard (128 rows) starts at row 128 * rank.
    layer = QKVParallelLinear(256, 64, 4, 1, tp_size=2, tp_rank=tp_rank, device="cpu")
    layer = convert_linear_to_fp8(layer, "layers.0.self_attn.qkv_proj", BLOCK)
    shards = {"q": _checkpoint(256, 256), "k": _checkpoint(64, 256), "v": _checkpoint(64, 256)}
    _load(layer, shards)
    assert layer.weight.dtype == torch.float8_e4m3fn and getattr(layer, SCALE_NAME).shape == (256, 2)
    dequantize_fp8_layer(layer, torch.float32)
    want = torch.cat([shards["q"][2][128 * tp_rank: 128 * (tp_rank + 1)], shards["k"][2], shards["v"][2]])
    assert torch.equal(layer.weight, want)
    assert not hasattr(layer, SCALE_NAME)


def test_merged_gate_up_unaligned_shard_keeps_each_rows_scale():
    # 192 rows per part split over 2 ranks: rank 1 starts mid-block (row 96).
    layer = MergedColumnParallelLinear(128, [192, 192], tp_size=2, tp_rank=1, device="cpu")
    layer = convert_linear_to_fp8(layer, "mlp.gate_up_proj", BLOCK)
    shards = {0: _checkpoint(192, 128), 1: _checkpoint(192, 128)}
    _load(layer, shards)
    dequantize_fp8_layer(layer, torch.float32)
    assert torch.equal(layer.weight, torch.cat([shards[0][2][96:], shards[1][2][96:]]))


def test_fp8_forward_matches_dequantized_forward():
    layer = convert_linear_to_fp8(RowParallelLinear(256, 64, bias=True, device="cpu"), "o_proj", BLOCK)
    layer = layer
    q, s, deq = _checkpoint(64, 256)
    _load(layer, {None: (q, s, deq)})
    nn.init.normal_(layer.bias)
    x = torch.randn(3, 256)
    fp8_out = layer(x)  # the FP8 path (torch reference of the block GEMM on a CPU)
    xq, xs = per_token_group_quant_fp8_ref(x)
    w_s = s.repeat_interleave(128, 0)[:64]
    assert torch.equal(fp8_out, fp8_block_gemm_ref(xq, xs, q, w_s, out_dtype=torch.float32) + layer.bias)
    exact = x @ deq.t() + layer.bias
    assert (fp8_out - exact).norm() / exact.norm() < 0.05  # activation rounding only
    dequantize_fp8_layer(layer, torch.float32)
    torch.testing.assert_close(layer(x), x @ deq.t() + layer.bias)


def test_row_parallel_shard_that_splits_a_block_is_refused():
    layer = RowParallelLinear(384, 64, tp_size=2, tp_rank=0, device="cpu")
    with pytest.raises(ValueError, match=r"model.layers.3.mlp.down_proj.weight: input size 384 .* 192 columns per "
                                         r"rank, not a multiple of the FP8 block size 128"):
        convert_linear_to_fp8(layer, "model.layers.3.mlp.down_proj", BLOCK)


def test_scale_of_the_wrong_shape_names_the_tensor():
    layer = convert_linear_to_fp8(RowParallelLinear(256, 64, device="cpu"), "x.o_proj", BLOCK)
    with pytest.raises(ValueError, match=r"x.o_proj.weight_scale_inv .* needs \[1, 2\]"):
        getattr(layer, SCALE_NAME).weight_loader(getattr(layer, SCALE_NAME), torch.ones(2, 2))


def test_dynamic_quantization_of_a_plain_linear():
    lin = nn.Linear(200, 130, bias=False)
    layer = quantize_fp8_layer(as_linear_base(lin), "proj", BLOCK)
    assert layer.weight.dtype == torch.float8_e4m3fn
    x = torch.randn(4, 200)
    rel = (layer(x) - lin(x)).norm() / lin(x).norm()
    assert rel < 0.05


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_per_channel_quantization_of_a_fused_shard_keeps_each_rows_scale(tp_rank):
    """quantization='fp8' on a float checkpoint quantizes the loaded (fused, sharded) weight per row:
    rank r's gate_up rows get exactly the per-channel scales and FP8 values that quantizing the whole
    [gate; up] weight gives those rows (192-row parts: rank 1 starts mid-block), every group of a row
    holds the row's scale, and the dequantized layer is that round trip."""
    from fxrewrite.layers.fp8_linear import quantize_weight_fp8_per_channel

    gate, up = torch.randn(192, 256), torch.randn(192, 256) * 3
    layer = MergedColumnParallelLinear(256, [192, 192], tp_size=2, tp_rank=tp_rank, bias=False, device="cpu")
    layer.weight_loader(layer.weight, gate, 0)
    layer.weight_loader(layer.weight, up, 1)
    layer = quantize_fp8_layer(layer, "mlp.gate_up_proj", BLOCK, per_channel=True)
    q, scale = quantize_weight_fp8_per_channel(torch.cat([gate, up]))
    rows = torch.cat([torch.arange(96) + 96 * tp_rank, torch.arange(96) + 192 + 96 * tp_rank])
    s = getattr(layer, SCALE_NAME)
    assert layer.weight_per_channel and torch.equal(s, scale[rows, None].expand(192, 2))
    assert torch.equal(layer.weight.view(torch.uint8), q[rows].view(torch.uint8))
    dequantize_fp8_layer(layer, torch.float32)
    assert torch.equal(layer.weight, q[rows].float() * scale[rows, None])


def test_per_channel_row_parallel_shard_round_trip():
    """A row-parallel shard (K split over ranks) gets one scale per row of its own columns."""
    w = torch.randn(64, 512)
    layer = RowParallelLinear(512, 64, tp_size=2, tp_rank=1, bias=False, device="cpu")
    layer.weight_loader(layer.weight, w)
    layer = quantize_fp8_layer(layer, "o_proj", BLOCK, per_channel=True)
    part = w[:, 256:]
    torch.testing.assert_close(getattr(layer, SCALE_NAME)[:, 0], part.abs().amax(1) / 448)
    dequantize_fp8_layer(layer, torch.float32)
    assert ((layer.weight - part).abs() / part.abs().amax(1, keepdim=True)).max() < 2 ** -4


@pytest.mark.parametrize("make, shards, want_rows", [
    (lambda r: QKVParallelLinear(256, 64, 4, 1, tp_size=2, tp_rank=r, device="cpu"),
     {"q": (256, 256), "k": (64, 256), "v": (64, 256)}, 64),
    (lambda r: QKVParallelLinear(256, 128, 4, 2, device="cpu"), {"q": (512, 256), "k": (256, 256), "v": (256, 256)}, 128),
    (lambda r: MergedColumnParallelLinear(128, [192, 192], tp_size=2, tp_rank=r, device="cpu"),
     {0: (192, 128), 1: (192, 128)}, 32),
    (lambda r: RowParallelLinear(256, 200, tp_size=2, tp_rank=r, device="cpu"), {None: (200, 256)}, 8),
], ids=["qkv-half-block-kv", "qkv", "gate-up-mid-block", "row-parallel"])
@pytest.mark.parametrize("tp_rank", [0, 1])
def test_scale_rows_runs_hold_one_scale_row(make, shards, want_rows, tp_rank):
    """weight_scale_rows (what lets the one-token GEMV scale x instead of the weight) is read off the layer's
    shapes; the loaded scales are then equal over every aligned run of that many rows, whatever the shard."""
    layer = convert_linear_to_fp8(make(tp_rank), "layer", BLOCK)
    assert layer.weight_scale_rows == want_rows
    _load(layer, {sid: _checkpoint(*shape) for sid, shape in shards.items()})
    scale, rows = getattr(layer, SCALE_NAME), layer.weight_scale_rows
    runs = scale.view(-1, rows, scale.shape[1])
    assert torch.equal(runs, runs[:, :1].expand_as(runs))
