"""RMSNorm with an optional fused residual add: Llama's ``w * x̂`` and Gemma's ``(1 + w) * x̂``.

Formula (transformers ``LlamaRMSNorm`` / ``Gemma2RMSNorm``): x̂ = x * rsqrt(mean(x², -1) + eps),
computed in float32. The op order of each is kept so the reference is bit-identical to them:
Llama casts x̂ back to the input dtype *before* multiplying by the weight; Gemma multiplies by
``offset + w`` in float32 and casts last.
"""

from __future__ import annotations

import torch

from fxrewrite.kernels import use_triton
from fxrewrite.kernels.pdl import gdc_prologue, pdl_enabled
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["rms_norm", "rms_norm_ref", "rms_norm_triton"]


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match the last "
                         f"dim of x {tuple(x.shape)}; expected [{x.shape[-1]}]")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, offset: float = 0.0):
    """Torch reference. x [..., H] (any float dtype), weight [H].

    With ``residual`` (same shape/dtype as x), x = x + residual first, in x's dtype as the HF
    decoder layer does, and ``(out, x + residual)`` is returned; otherwise ``out``.
    ``offset == 0``: out = weight * x̂.to(x.dtype) (dtype promoted like Llama);
    ``offset != 0``: out = (x̂ * (offset + weight.float())).to(x.dtype) (Gemma: offset 1.0).
    Raises ValueError on mismatched shapes.
    """
    _check(x, weight, residual)
    if residual is not None:
        x = x + residual
        residual = x
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    if offset == 0.0:
        out = weight * h.to(input_dtype)
    else:
        out = (h * (offset + weight.float())).type_as(x)
    return out if residual is None else (out, residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, offset: float = 0.0):
    """RMSNorm (+ fused residual add); Triton on CUDA, else :func:`rms_norm_ref` (same contract)."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual, offset)
    return rms_norm_ref(x, weight, eps, residual, offset)


@triton.jit
def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, rstd_ptr, n_cols, eps, offset,
                    HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, SAVE_RSTD: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    """One row per program: out = norm(x [+ residual]) * weight; with SAVE_RSTD, 1/rms (float32) goes to
    rstd_ptr[row] for the backward (`fxrewrite.kernels.rms_norm_backward`)."""
    gdc_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)  # with x, not after the reduction's barrier: one latency
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The add rounds in the input dtype, like `residual + hidden_states` in the HF layer.
        x = x + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    if SAVE_RSTD:
        tl.store(rstd_ptr + row, rstd)
    h = h * rstd
    if GEMMA:
        out = h * (offset + w.to(tl.float32))
    else:
        out = h.to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None, offset: float = 0.0, *, num_warps: int | None = None):
    """Triton kernel, one program per row; same contract as :func:`rms_norm_ref`."""
    _check(x, weight, residual)
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols).contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype) if offset == 0.0 else x.dtype
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    res_in = residual.reshape(-1, n_cols).contiguous() if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else x2
    block = next_power_of_2(n_cols)
    if x2.shape[0] == 0:
        return (out.view(x.shape), res_out.view(x.shape)) if residual is not None else out.view(x.shape)
    pdl = pdl_enabled(x.device)
    launch(rms_norm_kernel, (x2.shape[0],), x.device, pdl)(
        x2, res_in, weight, out, res_out, out, n_cols, eps, float(offset),
        HAS_RESIDUAL=residual is not None, GEMMA=offset != 0.0, SAVE_RSTD=False, BLOCK=block, PDL=pdl,
        num_warps=num_warps or min(16, max(1, block // 256)))
    out = out.view(*x.shape[:-1], n_cols)
    return out if residual is None else (out, res_out.view(x.shape))
