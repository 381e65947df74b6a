"""RMSNorm (+ fused residual add) for training: a Triton forward that saves rstd, a Triton backward.

Forward as :mod:`fxrewrite.kernels.rms_norm` (Llama ``w * x̂.to(dtype)``, Gemma ``(x̂ * (offset + w)).to(dtype)``,
float32 statistics). Saved for the backward, as Liger-Kernel's RMSNorm does: the normalised input
(``x + residual`` when fused, which is also the residual output, so it costs nothing extra; a strided
input such as a q/k head slice of a fused QKV output as the view itself, made contiguous again in the
backward) and ``rstd`` float32 [rows]; x̂ is recomputed. Backward (g = dy * w_eff, w_eff = w or offset + w; N = hidden):
``dx = rstd * (g - x̂ * mean(g * x̂))``, ``dw = sum_rows(dy * x̂)`` (float32 partial sums per program);
with a residual, the residual output's gradient is added to dx, which is the gradient of both inputs.
The reference is autograd through :func:`fxrewrite.kernels.rms_norm.rms_norm_ref`.
"""

from __future__ import annotations

import torch

from fxrewrite.kernels import use_triton
from fxrewrite.kernels.rms_norm import _check, rms_norm_kernel, rms_norm_ref
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["rms_norm_train", "RMSNormFunction"]


@triton.jit
def _bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dres_ptr, dx_ptr, dw_ptr, n_rows, n_cols, rows_per_program,
                offset, HAS_DRES: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        w = w + offset
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        row = start + i
        m = cols < tl.where(row < n_rows, n_cols, 0)  # rows past the end load zeros and add nothing to dw
        x = tl.load(x_ptr + row * n_cols + cols, mask=m, other=0.0)
        dy = tl.load(dy_ptr + row * n_cols + cols, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + tl.minimum(row, n_rows - 1))  # a masked row's dy is 0: any rstd will do
        xhat = x.to(tl.float32) * rstd
        if GEMMA:
            dw += dy * xhat
        else:  # Llama multiplies the weight by x̂ rounded to the input dtype
            dw += dy * xhat.to(x.dtype).to(tl.float32)
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
        if HAS_DRES:
            dx += tl.load(dres_ptr + row * n_cols + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)
    tl.store(dw_ptr + pid * n_cols + cols, dw, mask=mask)


@torch.compiler.assume_constant_result
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_programs(rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        return min(rows, 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device()))
    return min(rows, 4)  # the interpreter: few programs keep the test fast


class RMSNormFunction(torch.autograd.Function):
    """``apply(x, weight, residual_or_None, eps, offset) -> (out, residual_out_or_None)``; x [..., H]."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps, offset):
        _check(x, weight, residual)
        n = x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        rows = x2.shape[0]
        out_dtype = torch.promote_types(weight.dtype, x.dtype) if offset == 0.0 else x.dtype
        out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        res_out = torch.empty_like(x2) if residual is not None else x2
        res_in = residual.reshape(-1, n).contiguous() if residual is not None else x2
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = next_power_of_2(n)
        if rows:
            launch(rms_norm_kernel, (rows,), x.device)(
                x2, res_in, weight, out, res_out, rstd, n, eps, float(offset), HAS_RESIDUAL=residual is not None,
                GEMMA=offset != 0.0, SAVE_RSTD=True, BLOCK=block, num_warps=min(16, max(1, block // 256)))
        # A strided x (a head slice of a fused QKV output) is saved as the view, not as the contiguous copy:
        # the fused output stays alive anyway (attention saves v, another view of it), the copy would not.
        ctx.save_for_backward(x if residual is None else res_out, weight, rstd)
        ctx.offset, ctx.has_residual, ctx.shape = float(offset), residual is not None, x.shape
        out = out.view(x.shape[:-1] + (n,))
        return out, (res_out.view(x.shape) if residual is not None else None)

    @staticmethod
    def backward(ctx, dy, dres):
        x, weight, rstd = ctx.saved_tensors
        n = x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        rows = x2.shape[0]
        dy2 = dy.reshape(-1, n).contiguous()
        dres2 = dres.reshape(-1, n).contiguous() if (ctx.has_residual and dres is not None) else dy2
        dx = torch.empty_like(x2)
        programs = max(1, _num_programs(rows, x2.device))
        per = -(-rows // programs) if rows else 1
        dw = torch.zeros(programs, n, dtype=torch.float32, device=x2.device)
        block = next_power_of_2(n)
        if rows:
            launch(_bwd_kernel, (programs,), x2.device)(
                dy2, x2, weight, rstd, dres2, dx, dw, rows, n, per, ctx.offset,
                HAS_DRES=ctx.has_residual and dres is not None, GEMMA=ctx.offset != 0.0, BLOCK=block,
                num_warps=min(16, max(1, block // 256)))
        dx = dx.view(ctx.shape)
        dweight = dw.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dweight, (dx if ctx.has_residual else None), None, None


def rms_norm_train(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None, offset: float = 0.0):
    """Differentiable RMSNorm (+ residual add), same contract as :func:`rms_norm_ref`.

    Triton forward/backward (:class:`RMSNormFunction`) where :func:`fxrewrite.kernels.use_triton` says so,
    else autograd through the reference. Raises ValueError on mismatched shapes.
    """
    if not use_triton(x):
        return rms_norm_ref(x, weight, eps, residual, offset)
    out, res = RMSNormFunction.apply(x, weight, residual, eps, float(offset))
    return out if residual is None else (out, res)
