"""A checkpoint's pre-fused FP8 qkv_proj (Phi-3's layout) sharded over more ranks than it has kv heads: the block
scales cover the checkpoint's rows (q + 2 kv heads, each kv head once), and each rank takes the rows of its q heads
and of the kv head it replicates. It was refused: the expected scale grid counted the replicated kv heads too."""

from __future__ import annotations

import torch

from fxrewrite.layers.fp8_linear import SCALE_NAME, convert_linear_to_fp8
from fxrewrite.layers.linear import QKVParallelLinear


def test_prefused_qkv_scales_with_replicated_kv_heads():
    head, heads, kv_heads, hidden = 64, 4, 1, 256
    rows = (heads + 2 * kv_heads) * head  # 384 checkpoint rows: 3 blocks of 128
    scale = torch.arange(3 * 2, dtype=torch.float32).view(3, 2) + 1
    full = scale.repeat_interleave(128, dim=0)  # the scale of every checkpoint row
    for rank in (0, 1):
        layer = QKVParallelLinear(hidden, head, heads, kv_heads, tp_size=2, tp_rank=rank, params_dtype=torch.float32)
        convert_linear_to_fp8(layer, "qkv_proj", (128, 128))
        param = getattr(layer, SCALE_NAME)
        param.weight_loader(param, scale)  # shard None: the whole pre-fused tensor's scales
        q = full[rank * 128:(rank + 1) * 128]
        k, v = full[256:320], full[320:384]  # the one kv head, on both ranks
        assert torch.equal(param.data, torch.cat([q, k, v])), rank
    assert rows == full.shape[0]
