"""Linear projection + cross-entropy without the [tokens, vocab] logits: chunked over tokens, gradients in the forward.

Semantics (transformers ``ForCausalLMLoss`` after the LM head): ``logits = transform(hidden @ W.T + b)``,
``loss = sum over rows with target != ignore_index of CE(logits.float(), target)``; the caller divides by
the number of such rows (mean) or by ``num_items_in_batch``. Each chunk of rows computes its logits,
the loss and d(loss)/d(logits) (the Triton kernel :mod:`fxrewrite.kernels.cross_entropy` in place when the
transform is known to be ``scale`` / ``softcap``; otherwise autograd through ``transform`` and
``F.cross_entropy``, exactly transformers' computation), then ``dhidden = g @ W`` and ``dW += g.T @ hidden``;
the chunk's logits are freed. The backward only scales the stored gradients by the incoming one.
Peak extra memory: one chunk of logits (sized by :func:`default_chunk_size`'s memory rule) plus dhidden
[N, H] and dW [V, H]; on the Triton path nothing else is allocated per chunk. This is the approach of
Liger-Kernel's fused linear cross-entropy (Hsu et al., 2024, arXiv:2410.10989).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from fxrewrite.kernels import functorch_active, use_triton
from fxrewrite.kernels.cross_entropy import _transform, cross_entropy_grad_, cross_entropy_grad_torch

__all__ = ["fused_linear_cross_entropy", "fused_linear_cross_entropy_ref", "default_chunk_size", "forward_with_grads"]


def default_chunk_size(num_rows: int, vocab: int, hidden: int | None = None, budget: int = 1 << 27,
                       intermediate: int | None = None) -> int:
    """Rows per chunk, chosen by memory. A chunk's only transient is its logits, rows * vocab elements in
    the activation dtype (the kernel writes their gradient in place).

    - ``intermediate`` given (the model's MLP ``intermediate_size``, passed when activation checkpointing is
      on): the largest power of two with rows * vocab <= num_rows * 2 * intermediate, i.e. logits no larger
      than one layer's gate/up projection output [num_rows, 2 * intermediate]. Every layer's backward
      recomputes that tensor (and more) after the loss is done, so such a chunk never sets the step's peak
      (Qwen3-0.6B, 8 x 2048 tokens: 512 rows, 148 MiB, where the backward's peak is ~750 MiB above the
      loss's; ``python -m fxrewrite.benchmarks.train_memory``). Never fewer rows than the next rule.
    - with ``hidden``: the largest power of two <= ``hidden``, so one chunk of logits is no larger than
      d/dweight [vocab, hidden], which the loss holds for the whole step anyway. Every chunk reads and
      writes all of d/dweight (``addmm_``): Liger-Kernel's smaller rule (the power of two nearest above
      ``num_rows / ceil(vocab / hidden)``, logits about as large as the hidden states: Qwen3-0.6B, 8 x 2048
      tokens, 128 rows) moves 74 GiB per step there, this one 9 GiB, for 260 MiB more at the loss, which
      without checkpointing still leaves the step's peak below Liger's (its loss holds a float32 copy of
      d/dweight; ``python -m fxrewrite.benchmarks.train_memory --no-gradient-checkpointing``). Never fewer
      rows than Liger's rule, at least 64 and at most ``budget`` logits for that rule;
    - neither: the largest power of two with rows * vocab <= budget, at least 64.
    Never more than num_rows (and at least 1)."""
    cap = max(64, 1 << max(0, (budget // max(vocab, 1)).bit_length() - 1))
    rows = cap
    if hidden:
        per = -(-num_rows // -(-vocab // hidden))
        rows = max(min(cap, max(64, 1 << max(0, per - 1).bit_length())), 1 << (hidden.bit_length() - 1))
    if intermediate:
        fit = num_rows * 2 * intermediate // max(vocab, 1)
        rows = max(rows, 1 << max(0, fit.bit_length() - 1))
    return max(1, min(rows, num_rows))


def fused_linear_cross_entropy_ref(hidden, weight, bias, target, ignore_index: int = -100,
                                   transform: Callable | None = None) -> torch.Tensor:
    """Reference: the summed loss through full logits (autograd end to end)."""
    logits = F.linear(hidden, weight, bias)
    logits = transform(logits) if transform is not None else logits
    return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction="sum")


def _chunk_grad(z, t, ignore_index, transform, kernel_params):
    """(summed loss, d loss / d z) for one chunk of logits z [C, V]; the kernel overwrites z."""
    if kernel_params is not None and use_triton(z):
        scale, softcap = kernel_params
        z = z.contiguous()
        return cross_entropy_grad_(z, t, ignore_index, scale, softcap), z
    if kernel_params is not None and transform is None:  # the transform in numbers only (the custom op)
        return cross_entropy_grad_torch(z, t, ignore_index, *kernel_params)
    with torch.enable_grad():
        z = z.detach().requires_grad_()
        y = transform(z) if transform is not None else z
        loss = F.cross_entropy(y.float(), t, ignore_index=ignore_index, reduction="sum")
        (g,) = torch.autograd.grad(loss, z)
    return loss.detach(), g


def forward_with_grads(hidden, weight, bias, target, ignore_index, transform, kernel_params, chunk,
                       want_h: bool, want_w: bool, want_b: bool):
    """(summed loss float32 [], d/dhidden, d/dweight, d/dbias), each gradient None unless wanted: the chunk
    loop that the autograd function and the custom op of :mod:`.fused_linear_cross_entropy_op` share."""
    grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if want_h else None
    grad_w = torch.zeros_like(weight, memory_format=torch.contiguous_format) if want_w else None
    grad_b = torch.zeros_like(bias, dtype=torch.float32) if want_b else None
    same_dtype = hidden.dtype == weight.dtype and (bias is None or bias.dtype == hidden.dtype)
    if kernel_params is not None and same_dtype and use_triton(hidden):
        total = _kernel_loop(hidden, weight, bias, target, ignore_index, kernel_params, chunk, grad_h, grad_w, grad_b)
    else:
        total = _autograd_loop(hidden, weight, bias, target, ignore_index, transform, kernel_params, chunk,
                               grad_h, grad_w, grad_b)
    return total, grad_h, grad_w, (grad_b.to(bias.dtype) if want_b else None)


def _kernel_loop(hidden, weight, bias, target, ignore_index, kernel_params, chunk, grad_h, grad_w, grad_b):
    """Per chunk exactly three GEMMs and one cross-entropy kernel, nothing allocated and no host sync: the
    logits go into one preallocated [chunk, V] buffer, the kernel overwrites them with their gradient and
    writes the rows' losses into one [N] buffer (summed once at the end), d/dhidden is written in place
    (``mm(out=)``) and d/dweight accumulated in place (``addmm_``, in the weight's dtype, as Liger-Kernel)."""
    n = hidden.shape[0]
    scale, softcap = kernel_params
    logits = torch.empty((min(chunk, n), weight.shape[0]), dtype=hidden.dtype, device=hidden.device)
    losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
    col_sum = torch.empty_like(grad_b) if grad_b is not None else None  # one chunk's d/dbias
    w_t = weight.t()
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        h, z = hidden[s:e], logits[:e - s]
        if bias is None:
            torch.mm(h, w_t, out=z)
        else:
            torch.addmm(bias, h, w_t, out=z)
        cross_entropy_grad_(z, target[s:e], ignore_index, scale, softcap, losses=losses[s:e])
        if grad_h is not None:
            torch.mm(z, weight, out=grad_h[s:e])
        if grad_w is not None:
            grad_w.addmm_(z.t(), h)
        if grad_b is not None:
            grad_b.add_(torch.sum(z, 0, dtype=torch.float32, out=col_sum))
    return losses.sum()


def _autograd_loop(hidden, weight, bias, target, ignore_index, transform, kernel_params, chunk,
                   grad_h, grad_w, grad_b):
    """The general loop: any ``transform`` (autograd through the model's own code per chunk), autocast's
    mixed dtypes, and CPUs without the interpreter (the kernel's closed form in torch)."""
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    w_g = None  # the weight in the logits' dtype (they differ under autocast), cast once
    for s in range(0, hidden.shape[0], chunk):
        h, t = hidden[s:s + chunk], target[s:s + chunk]
        loss, g = _chunk_grad(F.linear(h, weight, bias), t, ignore_index, transform, kernel_params)
        total += loss
        if grad_h is not None:
            w_g = weight.to(g.dtype) if w_g is None else w_g
            grad_h[s:s + chunk] = g @ w_g
        if grad_w is not None:
            if g.dtype == h.dtype == grad_w.dtype:
                grad_w.addmm_(g.t(), h)
            else:
                grad_w += (g.t().float() @ h.float()).to(grad_w.dtype)
        if grad_b is not None:
            grad_b += g.float().sum(0)
    return total


def _differentiable_grads(ctx, grad_out):
    """The inputs' gradients as differentiable functions of them (create_graph=True: a gradient penalty, a
    second-order method), chunk by chunk: d loss / d logits by autograd through the reference, then the linear's
    partial derivatives as torch ops (autograd.grad to hidden would also follow hidden's own path to a tied weight).
    The stored first-order gradients cannot be differentiated: they were made without a graph."""
    hidden, weight, bias = ctx.saved_inputs
    target, ignore_index, transform, kernel_params, chunk = ctx.args
    if transform is None and kernel_params is not None:  # the transform given in numbers only
        transform = partial(_transform, scale=kernel_params[0], softcap=kernel_params[1])
    want_h, want_w, want_b = ctx.which
    grad_h, grad_w, grad_b = [], 0, 0
    with torch.enable_grad():
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            z = F.linear(h, weight, bias)
            y = transform(z) if transform is not None else z
            loss = F.cross_entropy(y.float(), target[s:s + chunk], ignore_index=ignore_index, reduction="sum")
            (dz,) = torch.autograd.grad(loss, z, grad_out, create_graph=True)
            grad_h += [dz @ weight] if want_h else []
            grad_w = grad_w + dz.t() @ h if want_w else grad_w
            grad_b = grad_b + dz.sum(0) if want_b else grad_b
    return (torch.cat(grad_h) if want_h else None, grad_w if want_w else None, grad_b if want_b else None,
            None, None, None, None, None)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, transform, kernel_params, chunk):
        want = ctx.needs_input_grad[:3]
        total, *grads = forward_with_grads(hidden, weight, bias, target, ignore_index, transform, kernel_params,
                                           chunk, *want)
        ctx.save_for_backward(*(x for x in grads if x is not None))
        # references to the inputs (no copy; autograd's version counters are not checked on them), for a backward
        # under create_graph only (`_differentiable_grads`)
        ctx.saved_inputs, ctx.args = (hidden, weight, bias), (target, ignore_index, transform, kernel_params, chunk)
        ctx.which, ctx.applied = want, None
        return total

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph=True
            return _differentiable_grads(ctx, grad_out)
        saved = iter(ctx.saved_tensors)
        if ctx.applied is None:
            # The first backward scales the stored gradients in place (as Liger-Kernel: no second copy), through
            # .data so that autograd's version check lets a later backward of a retained graph read them again.
            ctx.applied = grad_out.detach().clone()
            grads = [next(saved).data.mul_(grad_out) if want else None for want in ctx.which]
            return (*grads, None, None, None, None, None)
        if not bool(ctx.applied.ne(0)):  # a later backward (retain_graph=True): the first factor undone, on a copy
            raise RuntimeError("fused_linear_cross_entropy: a second backward through a graph whose first backward "
                               "scaled the loss by 0 cannot recover the gradients")
        factor = grad_out / ctx.applied
        grads = [next(saved) * factor if want else None for want in ctx.which]
        return (*grads, None, None, None, None, None)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               target: torch.Tensor, ignore_index: int = -100, transform: Callable | None = None,
                               kernel_params: tuple[float, float | None] | None = None,
                               chunk_size: int | None = None, intermediate_size: int | None = None) -> torch.Tensor:
    """Summed cross-entropy of ``transform(hidden @ weight.T + bias)`` against ``target``, differentiable.

    hidden [N, H] (float), weight [V, H], bias [V] or None, target int64 [N]. ``transform`` maps a chunk
    of logits [C, V] to transformed logits row by row (soft-capping, scaling; None: identity);
    ``kernel_params = (scale, softcap or None)`` says the same transform in numbers, letting the Triton
    kernel run on CUDA. Returns float32 []: the sum over rows whose target is not ``ignore_index``.
    Gradients flow to hidden, weight and bias. ``chunk_size`` rows per chunk (None: :func:`default_chunk_size`,
    given ``intermediate_size`` when the caller knows the layers' backward outlives the loss). ValueError on
    mismatched shapes.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or target.shape != hidden.shape[:1]:
        raise ValueError(f"fused_linear_cross_entropy: hidden {tuple(hidden.shape)} must be [N, H], weight "
                         f"{tuple(weight.shape)} [V, H], target {tuple(target.shape)} [N]")
    chunk = chunk_size or default_chunk_size(hidden.shape[0], weight.shape[0], hidden.shape[1],
                                             intermediate=intermediate_size)
    if not torch.is_grad_enabled() or functorch_active():  # no gradients to make, or torch.func makes them: the
        # chunked reference, summed (functorch differentiates / batches torch ops, not the Function)
        parts = [fused_linear_cross_entropy_ref(hidden[s:s + chunk], weight, bias, target[s:s + chunk], ignore_index,
                                                transform) for s in range(0, hidden.shape[0], chunk)]
        return sum(parts, torch.zeros((), dtype=torch.float32, device=hidden.device))
    return _FusedLinearCrossEntropy.apply(hidden, weight, bias, target, ignore_index, transform, kernel_params, chunk)
