"""Gated activations over the last dim: ``act(x[..., :d]) * x[..., d:]`` (vLLM SiluAndMul, GeluAndMul).

Formula source: the HF gated MLP ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with gate and
up merged into one projection whose output is ``[gate | up]``. The reference computes in the
input dtype, as the HF MLP does; the kernel computes in float32 and rounds once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxrewrite.kernels import use_triton
from fxrewrite.kernels.pdl import gdc_prologue, pdl_enabled
from fxrewrite.kernels.triton_utils import launch, tl, triton

__all__ = ["silu_and_mul", "silu_and_mul_ref", "gelu_and_mul", "gelu_and_mul_ref"]

_APPROXIMATE = ("none", "tanh")


def _half(x: torch.Tensor) -> int:
    if x.shape[-1] % 2:
        raise ValueError(f"gated activation: last dim {x.shape[-1]} of x {tuple(x.shape)} must be even "
                         "(expected [..., 2*d] holding [gate | up])")
    return x.shape[-1] // 2


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2*d] -> silu(x[..., :d]) * x[..., d:], [..., d], x's dtype. ValueError on odd last dim."""
    d = _half(x)
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_and_mul_ref(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """x [..., 2*d] -> gelu(x[..., :d], approximate) * x[..., d:]; approximate is "none" or "tanh"."""
    if approximate not in _APPROXIMATE:
        raise ValueError(f"gelu_and_mul: approximate={approximate!r}, expected one of {_APPROXIMATE}")
    d = _half(x)
    return F.gelu(x[..., :d], approximate=approximate) * x[..., d:]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU-and-mul; Triton on CUDA, else :func:`silu_and_mul_ref`."""
    if use_triton(x):
        return _act_and_mul_triton(x, 0)
    return silu_and_mul_ref(x)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU-and-mul; Triton on CUDA, else :func:`gelu_and_mul_ref`."""
    if approximate not in _APPROXIMATE:
        raise ValueError(f"gelu_and_mul: approximate={approximate!r}, expected one of {_APPROXIMATE}")
    if use_triton(x):
        return _act_and_mul_triton(x, 1 if approximate == "none" else 2)
    return gelu_and_mul_ref(x, approximate)


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, d, ACT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    gdc_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * 2 * d + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * d + d + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:  # silu
        act = gate * tl.sigmoid(gate)
    elif ACT == 1:  # exact gelu
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    else:  # tanh gelu; tanh(z) = 2*sigmoid(2z) - 1 (no tl tanh on every triton version)
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (1.0 + (2.0 * tl.sigmoid(2.0 * z) - 1.0))
    tl.store(out_ptr + row * d + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul_triton(x: torch.Tensor, act: int, *, block: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """Triton launch: act 0 silu, 1 gelu, 2 gelu-tanh; grid (rows, d / block). Knobs for the benchmark."""
    d = _half(x)
    x2 = x.reshape(-1, 2 * d).contiguous()
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    if x2.shape[0] and d:
        block = min(block, triton.next_power_of_2(d))
        pdl = pdl_enabled(x.device)
        launch(_act_and_mul_kernel, (x2.shape[0], triton.cdiv(d, block)), x.device, pdl)(
            x2, out, d, ACT=act, BLOCK=block, PDL=pdl, num_warps=num_warps)
    return out.view(*x.shape[:-1], d)
