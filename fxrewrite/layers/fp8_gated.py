"""Batch-1 decode's FP8 gate_up_proj with SiLU-and-mul in the GEMV's epilogue (`fxrewrite.kernels.fp8_gemv_gated`):
one kernel fewer per gated MLP, and down_proj reads the activation straight from it.

`gated_norm_forward` is what a native MLP calls before down_proj: it returns None (the caller runs its usual
gate_up -> SiLU-and-mul path) unless every condition of the fused kernel holds: an FP8 `MergedColumnParallelLinear`
of two equal parts without bias, 128-column scale groups, `SiluAndMul`, one token, the Triton kernels in use
(CUDA or the interpreter), not under torch.compile or autograd, the FP8 tuner's choice for this one-token product
the pipelined GEMV (`fp8_dispatch.PIPELINED`) and the skinny GEMV's none (so the fused kernel replaces the product
the layer would have run, with that product's config), and scales the kernel takes (`fp8_gemv_gated.supports`).
``FXREWRITE_FP8_GATED=0`` turns it off (a measurement switch).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from fxrewrite.kernels import fp8_dispatch, gemv_dispatch, use_triton
from fxrewrite.kernels.fp8_gemm import FP8_DTYPE
from fxrewrite.kernels.fp8_gemv_gated import fp8_gemv_gated_triton, supports
from fxrewrite.kernels.fp8_gemv_pipelined import PIPELINED_CONFIGS
from fxrewrite.layers.activation import SiluAndMul
from fxrewrite.layers.linear import MergedColumnParallelLinear

__all__ = ["gated_enabled", "gated_config", "gated_norm_forward"]


def gated_enabled() -> bool:
    """``FXREWRITE_FP8_GATED``: "1" (default) or "0"; ValueError naming another value."""
    value = os.environ.get("FXREWRITE_FP8_GATED", "1")
    if value not in ("0", "1"):
        raise ValueError(f"FXREWRITE_FP8_GATED={value!r}; expected '0' or '1'")
    return value == "1"


def gated_config(layer: nn.Module, x: torch.Tensor, act: nn.Module) -> tuple[int, ...] | None:
    """The pipelined GEMV config the fused kernel runs for `layer` on x [..., K], or None when it does not apply
    (module docstring)."""
    if not isinstance(layer, MergedColumnParallelLinear) or getattr(layer, "weight", None) is None:
        return None
    w = layer.weight
    if w.dtype != FP8_DTYPE or type(act) is not SiluAndMul or layer.bias is not None:
        return None
    sizes = layer.output_sizes_per_partition
    if len(sizes) != 2 or sizes[0] != sizes[1] or layer.weight_block_size[1] != 128 or x.numel() != x.shape[-1]:
        return None
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and x.requires_grad) or not use_triton(x):
        return None
    if not gated_enabled():
        return None
    n, k = w.shape
    per_channel = layer.weight_per_channel
    backend = fp8_dispatch.choose(n, k, 1, per_channel)
    if not backend.startswith(fp8_dispatch.PIPELINED + ":"):
        return None
    fmt = gemv_dispatch.weight_format(w, layer.weight_scale_inv, per_channel)
    if gemv_dispatch.choose("norm", n, k, 1, fmt) is not None or gemv_dispatch.choose("linear", n, k, 1, fmt):
        return None
    config = PIPELINED_CONFIGS[int(backend.split(":")[1])]
    return config if supports(config, sizes[0], per_channel, layer.weight_scale_rows) else None


def gated_norm_forward(layer: nn.Module, x: torch.Tensor, norm: nn.Module | None, residual: torch.Tensor | None,
                       act: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(act(layer(norm(x))) [..., I], the new residual) by the fused kernel, or None when it does not apply
    (`gated_config`). `norm` None: x is the layer's input itself (residual returned unchanged); else as
    `LinearBase.norm_forward` (residual None: x becomes the residual)."""
    config = gated_config(layer, x, act)
    if config is None:
        return None
    if norm is None:
        h = x
    else:
        h, residual = (norm(x), x) if residual is None else norm(x, residual)
    h2 = h.reshape(1, h.shape[-1])
    if h2.stride(1) != 1:
        h2 = h2.contiguous()
    out = fp8_gemv_gated_triton(h2, layer.weight, layer.weight_scale_inv, config, layer.weight_per_channel,
                                layer.weight_scale_rows)
    return out.view(*x.shape[:-1], -1), residual
