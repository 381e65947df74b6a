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
from torch.autograd.function import once_differentiable

from fxrewrite.kernels import compiled_training_kernels, use_triton
from fxrewrite.kernels.rms_norm import _check, rms_norm_kernel, rms_norm_ref
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["rms_norm_train", "RMSNormFunction", "rms_norm_fwd", "rms_norm_bwd"]


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


def rms_norm_fwd(x, weight, residual, eps: float, offset: float):
    """Triton forward: (out [x.shape], x + residual [x.shape] or None, rstd float32 [rows])."""
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
            GEMMA=offset != 0.0, SAVE_RSTD=True, BLOCK=block, PDL=False, num_warps=min(16, max(1, block // 256)))
    return out.view(x.shape), (res_out.view(x.shape) if residual is not None else None), rstd


def rms_norm_bwd(dy, dres, x, weight, rstd, offset: float):
    """Triton backward from the saved normalised input x (``x + residual`` when fused): (dx [x.shape] in x's
    dtype, dweight float32 [H]); ``dres`` (the residual output's gradient, or None) is added to dx."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    rows = x2.shape[0]
    dy2 = dy.reshape(-1, n).contiguous()
    dres2 = dres.reshape(-1, n).contiguous() if dres is not None else dy2
    dx = torch.empty_like(x2)
    programs = max(1, _num_programs(rows, x2.device))
    per = -(-rows // programs) if rows else 1
    # every program writes its whole dw row (rows past the end add zeros): no zero fill unless nothing runs
    dw = (torch.empty if rows else torch.zeros)(programs, n, dtype=torch.float32, device=x2.device)
    block = next_power_of_2(n)
    if rows:
        launch(_bwd_kernel, (programs,), x2.device)(
            dy2, x2, weight, rstd, dres2, dx, dw, rows, n, per, float(offset), HAS_DRES=dres is not None,
            GEMMA=offset != 0.0, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return dx.view(x.shape), dw.sum(0)


class RMSNormFunction(torch.autograd.Function):
    """``apply(x, weight, residual_or_None, eps, offset) -> (out, residual_out_or_None)``; x [..., H]."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps, offset):
        out, res_out, rstd = rms_norm_fwd(x, weight, residual, eps, offset)
        # A strided x (a head slice of a fused QKV output) is saved as the view, not as the contiguous copy:
        # the fused output stays alive anyway (attention saves v, another view of it), the copy would not.
        ctx.save_for_backward(x if residual is None else res_out, weight, rstd)
        ctx.offset, ctx.has_residual = float(offset), residual is not None
        return out, res_out

    @staticmethod
    @once_differentiable  # kernels, not torch ops: create_graph=True raises, never a silent zero
    def backward(ctx, dy, dres):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_bwd(dy, dres if ctx.has_residual else None, x, weight, rstd, ctx.offset)
        dweight = dw.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dweight, (dx if ctx.has_residual else None), None, None


@torch.library.custom_op("fxrewrite::rms_norm_train", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float,
                 offset: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, res_out, rstd = rms_norm_fwd(x, weight, residual, eps, offset)
    return out, (x.new_empty(0) if res_out is None else res_out), rstd  # an op returns tensors, never None


@_rms_norm_op.register_fake
def _(x, weight, residual, eps, offset):
    out_dtype = torch.promote_types(weight.dtype, x.dtype) if offset == 0.0 else x.dtype
    res = x.new_empty(0) if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    return x.new_empty(x.shape, dtype=out_dtype), res, x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


@torch.library.custom_op("fxrewrite::rms_norm_train_backward", mutates_args=())
def _rms_norm_backward_op(dy: torch.Tensor, dres: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor,
                          rstd: torch.Tensor, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_bwd(dy, dres, x, weight, rstd, offset)


@_rms_norm_backward_op.register_fake
def _(dy, dres, x, weight, rstd, offset):
    return x.new_empty(x.shape), weight.new_empty(weight.shape, dtype=torch.float32)


def _rms_setup(ctx, inputs, output):
    x, weight, residual, _, offset = inputs
    ctx.save_for_backward(x if residual is None else output[1], weight, output[2])
    ctx.offset, ctx.has_residual = offset, residual is not None


def _rms_backward(ctx, dy, dres, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.fxrewrite.rms_norm_train_backward(dy, dres if ctx.has_residual else None, x, weight, rstd,
                                                         ctx.offset)
    return dx, dw.to(weight.dtype), (dx if ctx.has_residual else None), None, None


_rms_norm_op.register_autograd(_rms_backward, setup_context=_rms_setup)


def rms_norm_train(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None, offset: float = 0.0):
    """Differentiable RMSNorm (+ residual add), same contract as :func:`rms_norm_ref`.

    Triton forward/backward (:class:`RMSNormFunction`) where :func:`fxrewrite.kernels.use_triton` says so,
    else autograd through the reference. Raises ValueError on mismatched shapes.
    """
    if compiled_training_kernels(x):  # opt-in: the Triton pair as one opaque op in the compiled graph
        out, res, _ = torch.ops.fxrewrite.rms_norm_train(x, weight, residual, float(eps), float(offset))
        return out if residual is None else (out, res)
    if not use_triton(x):
        return rms_norm_ref(x, weight, eps, residual, offset)
    out, res = RMSNormFunction.apply(x, weight, residual, eps, float(offset))
    return out if residual is None else (out, res)
