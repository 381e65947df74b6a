"""Gated activations for training: ``act(x[..., :d]) * x[..., d:]`` with a Triton backward that recomputes.

Forward: the kernel of :mod:`fxrewrite.kernels.activation` (float32 math, one rounding). Only the input
``x = [gate | up]`` is saved (as Liger-Kernel's SwiGLU saves its two inputs); the backward recomputes the
activation. With ``inplace_backward`` (for an input that nothing else reads, such as the fused gate_up
output) the gradient overwrites the saved input, as Liger-Kernel's SwiGLU backward does: no [..., 2*d]
buffer is allocated at the MLP's backward, where training memory peaks under gradient checkpointing.
A backward that keeps the graph (``retain_graph=True``) writes a new buffer instead. Derivatives (a = act(gate)): d_gate = dy * up * act'(gate), d_up = dy * a, with
silu' = s * (1 + g * (1 - s)), s = sigmoid(g); exact gelu' = Phi(g) + g * phi(g);
tanh gelu (u = k * (g + 0.044715 g³), t = tanh(u)) gelu' = 0.5 * (1 + t) + 0.5 * g * (1 - t²) * k * (1 + 3 * 0.044715 g²),
k = sqrt(2 / pi) (Hendrycks & Gimpel, "Gaussian Error Linear Units", 2016). The reference is autograd through
:func:`silu_and_mul_ref` / :func:`gelu_and_mul_ref`.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from fxrewrite.kernels import compiled_training_kernels, use_triton
from fxrewrite.kernels.activation import _APPROXIMATE, _act_and_mul_triton, _half, gelu_and_mul_ref, silu_and_mul_ref
from fxrewrite.kernels.triton_utils import launch, tl, triton

__all__ = ["act_and_mul_train", "ActAndMulFunction"]

_ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _bwd_kernel(x_ptr, dy_ptr, dx_ptr, d, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(x_ptr + row * 2 * d + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * d + d + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * d + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        s = tl.sigmoid(g)
        act = g * s
        dact = s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        act = g * cdf
        dact = cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
    else:
        k = 0.7978845608028654
        t = 2.0 * tl.sigmoid(2.0 * k * (g + 0.044715 * g * g * g)) - 1.0
        act = 0.5 * g * (1.0 + t)
        dact = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * g * g)
    tl.store(dx_ptr + row * 2 * d + cols, (dy * up * dact).to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + row * 2 * d + d + cols, (dy * act).to(dx_ptr.dtype.element_ty), mask=mask)


class ActAndMulFunction(torch.autograd.Function):
    """``apply(x [..., 2*d], act, inplace_backward) -> [..., d]``; act is "silu", "gelu" or "gelu_tanh"."""

    @staticmethod
    def forward(ctx, x, act, inplace_backward=False):
        code = _ACT_CODES[act]
        out = _act_and_mul_triton(x, code)
        ctx.save_for_backward(x)
        ctx.code, ctx.inplace = code, inplace_backward
        return out

    @staticmethod
    @once_differentiable  # kernels, not torch ops: create_graph=True raises, never a silent zero
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        d = _half(x)
        x2 = x.reshape(-1, 2 * d).contiguous()
        dy2 = dy.reshape(-1, d).contiguous()
        # dx overwrites x2 (each program reads its elements before writing them) when x2 is our own copy,
        # or when allowed and no later backward of a kept graph reads the saved input again
        inplace = x2.data_ptr() != x.data_ptr() or (ctx.inplace and not _keep_graph())
        return _backward(x2, dy2, x2 if inplace else torch.empty_like(x2), ctx.code).view(x.shape), None, None


def _backward(x2, dy2, dx, code: int) -> torch.Tensor:
    d = x2.shape[-1] // 2
    if x2.shape[0] and d:
        block = min(1024, triton.next_power_of_2(d))
        launch(_bwd_kernel, (x2.shape[0], triton.cdiv(d, block)), x2.device)(
            x2, dy2, dx, d, ACT=code, BLOCK=block, num_warps=4)
    return dx


@torch.library.custom_op("fxrewrite::act_and_mul_train", mutates_args=())
def _act_op(x: torch.Tensor, code: int) -> torch.Tensor:
    return _act_and_mul_triton(x, code)


@_act_op.register_fake
def _(x, code):
    return x.new_empty(x.shape[:-1] + (x.shape[-1] // 2,))


@torch.library.custom_op("fxrewrite::act_and_mul_train_backward", mutates_args=())
def _act_backward_op(x: torch.Tensor, dy: torch.Tensor, code: int) -> torch.Tensor:
    """Out of place: a compiled backward may not write over its saved input."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    dx = _backward(x2, dy.reshape(-1, x.shape[-1] // 2).contiguous(), torch.empty_like(x2), code)
    return dx.view(x.shape)


@_act_backward_op.register_fake
def _(x, dy, code):
    return x.new_empty(x.shape)


def _act_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.code = inputs[1]


def _act_backward(ctx, dy):
    return torch.ops.fxrewrite.act_and_mul_train_backward(ctx.saved_tensors[0], dy, ctx.code), None


_act_op.register_autograd(_act_backward, setup_context=_act_setup)


def _keep_graph() -> bool:
    """Whether the running backward keeps the graph (True where torch cannot say)."""
    get = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if get is None else bool(get())


def act_and_mul_train(x: torch.Tensor, act: str = "silu", inplace_backward: bool = False) -> torch.Tensor:
    """Differentiable ``act(x[..., :d]) * x[..., d:]``: x [..., 2*d] -> [..., d] in x's dtype.

    act: "silu", "gelu" (exact) or "gelu_tanh". Triton forward/backward where
    :func:`fxrewrite.kernels.use_triton` says so, else autograd through the reference. ``inplace_backward``:
    the Triton backward writes x's gradient over x (only for an x that nothing else reads).
    ValueError on an unknown act or an odd last dim.
    """
    if act not in _ACT_CODES:
        raise ValueError(f"act_and_mul_train: act={act!r}, expected one of {sorted(_ACT_CODES)}")
    _half(x)
    if compiled_training_kernels(x):  # opt-in: the Triton pair as one opaque op in the compiled graph
        return torch.ops.fxrewrite.act_and_mul_train(x, _ACT_CODES[act])
    if not use_triton(x):
        if act == "silu":
            return silu_and_mul_ref(x)
        return gelu_and_mul_ref(x, _APPROXIMATE[1] if act == "gelu_tanh" else _APPROXIMATE[0])
    return ActAndMulFunction.apply(x, act, inplace_backward)
