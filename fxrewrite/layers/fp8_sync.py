"""Weight sync into FP8 layers (`fxrewrite.runtime.worker.weight_sync`): float tensors from a trainer quantized as
loading quantized them, so syncing the weights an engine serves changes nothing and it never serves unrounded ones."""

from __future__ import annotations

import torch
from torch import nn

from fxrewrite.kernels.fp8_gemm import FP8_DTYPE
from fxrewrite.layers.fp8_linear import Fp8LinearMixin, dequantize_weight_fp8, quantize_weight_fp8
from fxrewrite.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear

__all__ = ["load_block_quantized", "part_rows", "fp8_sync_staging"]


def load_block_quantized(layer: LinearBase, loaded: torch.Tensor, shard_id=None) -> None:
    """A float tensor of a checkpoint's part `shard_id` (unsharded: q_proj, gate_proj, ...; None: the whole weight)
    into a block-scaled FP8 layer as an FP8 checkpoint's part loads: rounded to the model's dtype, quantized in
    `weight_block_size` blocks over the whole tensor (the checkpoint's grid, whatever rows this rank holds), then
    this rank's e4m3 rows and scales through the layer's loaders; on a layer dequantized for the CPU, the dequantized
    values. Weight sync's path for block-scaled layers (per-channel ones: `requantize_fp8_layer`)."""
    q, scale = quantize_weight_fp8(loaded.to(layer.weight_source_dtype).float(), layer.weight_block_size)
    args = () if shard_id is None else (shard_id,)
    if layer.weight.dtype == FP8_DTYPE:
        layer.weight.weight_loader(layer.weight, q, *args)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale, *args)
    else:
        values = dequantize_weight_fp8(q, scale, layer.weight_block_size).to(layer.weight.dtype)
        layer.weight.weight_loader(layer.weight, values, *args)


def part_rows(layer: LinearBase, shard_id) -> list[tuple[int, int]]:
    """This rank's [start, end) rows of the weight that checkpoint part `shard_id` fills (q / k / v, a gate_up
    part; None: every part of a fused layer, the whole weight of another)."""
    if isinstance(layer, QKVParallelLinear):
        ids, sizes = ("q", "k", "v"), [layer.q_size, layer.kv_size, layer.kv_size]
    elif isinstance(layer, MergedColumnParallelLinear):
        ids, sizes = tuple(range(len(layer.output_sizes))), list(layer.output_sizes_per_partition)
    else:
        return [(0, layer.weight.shape[0])]
    return [(sum(sizes[:i]), sum(sizes[: i + 1])) for i, sid in enumerate(ids) if shard_id is None or sid == shard_id]


def fp8_sync_staging(layer: nn.Module) -> nn.Parameter | None:
    """For an FP8 layer, a copy of its current weight (dequantized) in the dtype it was quantized from, with the
    layer's weight loader, for a weight sync to load float tensors into (rounded to that dtype, as loading rounded
    them) before `requantize_fp8_layer`; None for any other layer."""
    if not isinstance(layer, Fp8LinearMixin):
        return None
    w = layer.weight.detach()
    if w.dtype == FP8_DTYPE:
        k = w.shape[1]
        w = w.float() * layer.weight_scale_inv.repeat_interleave(layer.weight_block_size[1], dim=1)[:, :k]
    staging = nn.Parameter(w.to(layer.weight_source_dtype, copy=True), requires_grad=False)
    staging.weight_loader = layer.weight.weight_loader
    return staging
