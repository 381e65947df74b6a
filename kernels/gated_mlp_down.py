"""Gated MLP tail for training: ``down(act(x[..., :d]) * x[..., d:])`` saving only x = [gate | up].

The plain chain (the activation's Function, then ``F.linear``) saves the activation output a [N, d] for
d(loss)/d(down.weight) = dy.T @ a, and at the backward allocates d(loss)/da [N, d] while a is still alive:
two [N, d] tensors at the MLP's backward, where training memory peaks under activation checkpointing, and
one per layer for the whole step without checkpointing (Qwen3-0.6B, 8 x 2048 tokens: 96 MiB each). This
Function saves x and the weight only and runs over row chunks. Its backward recomputes a chunk of a with the
forward's kernel (the same bits), adds dy.T @ a to dweight's float32 running sum, writes da = dy @ W over a
(``mm(out=)``), then runs the activation's backward kernel from da (over x itself when ``inplace_backward``,
as :mod:`.activation_backward` does): one chunk of a at a time, never larger than the output, or all rows at once
(dweight one matmul, no sum) where the float32 sum would cost more memory than the chunks save. Cost: one more
activation kernel per backward (reads x, writes a) and a few more, smaller launches.
The reference is :func:`act_and_mul_down_ref` (autograd through the activation's reference and F.linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fxrewrite.kernels import compiled_training_kernels
from fxrewrite.kernels.activation import _APPROXIMATE, _act_and_mul_triton, _half, gelu_and_mul_ref, silu_and_mul_ref
from fxrewrite.kernels.activation_backward import _ACT_CODES, _backward, _keep_graph

__all__ = ["ActAndMulDownFunction", "act_and_mul_down_ref", "act_and_mul_down_train"]


def act_and_mul_down_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         act: str = "silu") -> torch.Tensor:
    """Reference: ``F.linear(act(x[..., :d]) * x[..., d:], weight, bias)``; x [..., 2*d], weight [out, d]."""
    if act == "silu":
        a = silu_and_mul_ref(x)
    else:
        a = gelu_and_mul_ref(x, _APPROXIMATE[1] if act == "gelu_tanh" else _APPROXIMATE[0])
    return F.linear(a, weight, bias)


def _row_chunk(rows: int, d: int, out_features: int, accumulate: bool = False) -> int:
    """Rows per chunk: a chunk of a [rows, d] no larger than the output [rows, out] (a multiple of 128 rows).

    ``accumulate`` (the backward, with d/dweight wanted): several chunks also need d/dweight's float32 running sum
    [out, d]; when that and one chunk outweigh the whole of a, one chunk (all rows) is leaner and faster: the
    weight gradient is one matmul, no float32 pass (Llama-3.1-8B, 2048 rows: a is 56 MiB, a chunk 14 MiB, the sum 224 MiB)."""
    parts = max(1, -(-d // max(out_features, 1)))
    step = max(128, -(-(-(-rows // parts)) // 128) * 128)
    if accumulate and step < rows and 2 * step * d + 4 * out_features * d >= 2 * rows * d:  # bf16 a, float32 sum
        return rows
    return step


class ActAndMulDownFunction(torch.autograd.Function):
    """``apply(x [..., 2*d], weight [out, d], bias [out] or None, act, inplace_backward) -> [..., out]``.

    Both ways run over row chunks (:func:`_row_chunk`): a chunk of a is the only transient, never more than
    the output's size (under checkpointing the recomputed forward ends here with all the layer's saved
    tensors alive)."""

    @staticmethod
    def forward(ctx, x, weight, bias, act, inplace_backward):
        code = _ACT_CODES[act]
        out = _forward(x, weight, bias, code)
        ctx.save_for_backward(x, weight)
        ctx.code, ctx.inplace, ctx.has_bias = code, inplace_backward, bias is not None
        return out

    @staticmethod
    @once_differentiable  # kernels, not torch ops: create_graph=True raises, never a silent zero
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        want_x, want_w, want_b = ctx.needs_input_grad[:3]
        dx, dweight, dbias = _backward_chunks(dy, x, weight, ctx.code, want_x, want_w, ctx.has_bias and want_b,
                                              ctx.inplace and not _keep_graph())
        return dx, dweight, dbias, None, None


def _forward(x, weight, bias, code: int) -> torch.Tensor:
    d = _half(x)
    x2 = x.reshape(-1, 2 * d)
    out = torch.empty((x2.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    step = _row_chunk(x2.shape[0], d, weight.shape[0])
    for s in range(0, x2.shape[0], step):
        a = _act_and_mul_triton(x2[s:s + step], code)  # dies after its chunk: not saved
        if bias is None:
            torch.mm(a, weight.t(), out=out[s:s + step])
        else:
            torch.addmm(bias, a, weight.t(), out=out[s:s + step])
        del a  # before the next chunk's a is allocated
    return out.view(*x.shape[:-1], weight.shape[0])


def _backward_chunks(dy, x, weight, code: int, want_x: bool, want_w: bool, want_b: bool, inplace: bool):
    """(dx or None, dweight or None, dbias or None); dx over x itself when ``inplace`` (or x's contiguous copy)."""
    d = _half(x)
    x2 = x.reshape(-1, 2 * d).contiguous()
    dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
    dweight = torch.empty(weight.shape, dtype=dy2.dtype, device=x.device) if want_w else None
    dx = (x2 if inplace or x2.data_ptr() != x.data_ptr() else torch.empty_like(x2)) if want_x else None
    step = _row_chunk(x2.shape[0], d, weight.shape[0], accumulate=want_w)
    # d/dweight over several chunks: accumulated in float32 by the matmul itself (a running sum in bf16,
    # or chunk products rounded to bf16, missed the one-matmul result by up to ~1 on the H200 test's
    # 8192-row sums, where chunk products cancel)
    total = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if want_w and step < len(x2) else None
    for s in range(0, x2.shape[0], step):
        xc, dyc = x2[s:s + step], dy2[s:s + step]
        a = _act_and_mul_triton(xc, code)  # recomputed: the forward's bits
        if want_w:
            _accumulate_dweight(dweight, total, dyc, a)
        if want_x:  # da over a, then the activation's backward from it (over x when in place)
            _backward(xc, torch.mm(dyc, weight, out=a), dx[s:s + step], code)
        del a
    if total is not None:
        dweight.copy_(total)
    dbias = dy2.sum(0) if want_b else None
    return (dx.view(x.shape) if want_x else None), dweight, dbias


def _accumulate_dweight(dweight: torch.Tensor, total: torch.Tensor | None, dy: torch.Tensor, a: torch.Tensor) -> None:
    """dweight = dy^T a (one chunk), or total += dy^T a in float32 (mm's out_dtype on CUDA; float32 math
    elsewhere: the interpreter tests run in float32)."""
    if total is None:
        torch.mm(dy.t(), a, out=dweight)
    elif dy.is_cuda:
        torch.addmm(total, dy.t(), a, out_dtype=torch.float32, out=total)
    else:
        total.addmm_(dy.t().float(), a.float())


@torch.library.custom_op("fxrewrite::act_and_mul_down_train", mutates_args=())
def _down_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, code: int) -> torch.Tensor:
    return _forward(x, weight, bias, code)


@_down_op.register_fake
def _(x, weight, bias, code):
    return x.new_empty(x.shape[:-1] + (weight.shape[0],))


@torch.library.custom_op("fxrewrite::act_and_mul_down_train_backward", mutates_args=())
def _down_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, code: int, want_x: bool,
                      want_w: bool, want_b: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Out of place (a compiled backward may not write over its saved input); an empty tensor: not wanted."""
    dx, dweight, dbias = _backward_chunks(dy, x, weight, code, want_x, want_w, want_b, inplace=False)
    empty = x.new_empty(0)
    return (empty if dx is None else dx), (empty if dweight is None else dweight), (empty if dbias is None else dbias)


@_down_backward_op.register_fake
def _(dy, x, weight, code, want_x, want_w, want_b):
    empty = x.new_empty(0)
    return (torch.empty_like(x, memory_format=torch.contiguous_format) if want_x else empty,
            weight.new_empty(weight.shape, dtype=dy.dtype) if want_w else empty, dy.new_empty(dy.shape[-1]) if want_b else empty)


def _down_setup(ctx, inputs, output):
    x, weight, bias, code = inputs
    ctx.save_for_backward(x, weight)
    ctx.code, ctx.has_bias = code, bias is not None


def _down_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    want_x, want_w, want_b = ctx.needs_input_grad[:3]
    dx, dw, db = torch.ops.fxrewrite.act_and_mul_down_train_backward(dy, x, weight, ctx.code, want_x, want_w,
                                                                     ctx.has_bias and want_b)
    return (dx if want_x else None), (dw if want_w else None), (db if ctx.has_bias and want_b else None), None


_down_op.register_autograd(_down_backward, setup_context=_down_setup)


def act_and_mul_down_train(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str = "silu",
                           inplace_backward: bool = False) -> torch.Tensor:
    """Differentiable ``F.linear(act(x[..., :d]) * x[..., d:], weight, bias)`` through
    :class:`ActAndMulDownFunction` (Triton activation kernels; call it only where
    :func:`fxrewrite.kernels.use_triton` holds), or while torch.compile traces (`compiled_training_kernels`)
    the custom op ``fxrewrite::act_and_mul_down_train`` (its backward out of place). x [..., 2*d] float, weight [out, d], bias [out] or None;
    returns [..., out] in x's dtype. ``inplace_backward``: x's gradient overwrites x (only for an x that
    nothing else reads). ValueError on an unknown act, an odd last dim or mismatched shapes."""
    if act not in _ACT_CODES:
        raise ValueError(f"act_and_mul_down_train: act={act!r}, expected one of {sorted(_ACT_CODES)}")
    d = _half(x)
    if weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(f"act_and_mul_down_train: weight {tuple(weight.shape)} must be [out, {d}] for x "
                         f"{tuple(x.shape)}")
    if compiled_training_kernels(x):  # under torch.compile: one opaque op each way, saving what the Function saves
        return torch.ops.fxrewrite.act_and_mul_down_train(x, weight, bias, _ACT_CODES[act])
    return ActAndMulDownFunction.apply(x, weight, bias, act, inplace_backward)
