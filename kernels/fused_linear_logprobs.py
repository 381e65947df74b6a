"""Log-probabilities of target tokens under a linear LM head, without the [tokens, vocab] logits.

``logprob[r] = y[r, t_r] - logsumexp(y[r])`` with ``y = transform(hidden @ W.T + b)`` in float32, where the
transform is ``scale * z`` or Gemma 2's ``softcap * tanh(scale * z / softcap)`` (``scale = 1 / temperature``
gives a sampler's temperature). This is minus the cross-entropy with reduction "none", what an RL trainer
needs for the sampled tokens: the loss (GRPO/PPO's clipped ratio) weights every token differently, so the
fused linear cross-entropy's trick of finishing the gradient in the forward (one scalar scales it later)
does not apply. Instead the forward keeps only the [N] logprobs, and the backward, given d(out)/d(logprob)
per row, recomputes each chunk's logits and writes the weighted softmax gradient over them in place
(:func:`fxrewrite.kernels.cross_entropy.cross_entropy_grad_` with ``row_scale``), then ``dhidden = g @ W``
and ``dW += g.T @ hidden``: four GEMMs per chunk in all, one [chunk, vocab] buffer, no float32 copy.
The chunking and the in-place gradient are Liger-Kernel's fused linear cross-entropy's (Hsu et al., 2024,
arXiv:2410.10989); :func:`fused_linear_logprobs_ref` is the same numbers through full logits and autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fxrewrite.kernels import functorch_active, use_triton
from fxrewrite.kernels.cross_entropy import cross_entropy_grad_
from fxrewrite.kernels.fused_linear_cross_entropy import default_chunk_size
from fxrewrite.kernels.log_softmax import log_softmax_float32

__all__ = ["fused_linear_logprobs", "fused_linear_logprobs_ref", "fused_linear_token_loss"]

_NO_IGNORE = -100  # never a token id: every row counts


def _transform(z: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    y = z.float() * scale
    return softcap * torch.tanh(y / softcap) if softcap else y


def fused_linear_logprobs_ref(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              target: torch.Tensor, scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """Reference: float32 [N] through the full logits [N, V] (log_softmax, gather), autograd end to end."""
    y = _transform(F.linear(hidden, weight, bias), scale, softcap)
    return log_softmax_float32(y).gather(1, target[:, None]).squeeze(1)


def _chunk_logits(h, weight, bias, out=None):
    if out is None:
        return F.linear(h, weight, bias)
    return torch.mm(h, weight.t(), out=out) if bias is None else torch.addmm(bias, h, weight.t(), out=out)


def _forward(hidden, weight, bias, target, scale, softcap, chunk) -> torch.Tensor:
    n = hidden.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=hidden.device)
    kernel = use_triton(hidden)
    buf = torch.empty((min(chunk, n), weight.shape[0]), dtype=hidden.dtype, device=hidden.device) if kernel else None
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        if kernel:  # the kernel writes the row's cross-entropy (and overwrites the logits: unused here)
            cross_entropy_grad_(_chunk_logits(hidden[s:e], weight, bias, buf[:e - s]), target[s:e], _NO_IGNORE,
                                scale, softcap, losses=out[s:e])
        else:
            y = _transform(_chunk_logits(hidden[s:e], weight, bias), scale, softcap)
            out[s:e] = torch.logsumexp(y, dim=-1) - y.gather(1, target[s:e, None]).squeeze(1)
    return out.neg_()


def _weighted_grad_torch(z, t, scale, softcap, weight_rows) -> torch.Tensor:
    """d(sum_r w_r * logprob_r)/dz for logits z [C, V]: w_r * (onehot(t_r) - softmax(y_r)) * dy/dz, float32."""
    y = _transform(z, scale, softcap)
    g = torch.softmax(y, dim=-1).neg_()
    g[torch.arange(g.shape[0], device=g.device), t] += 1.0
    dydz = scale * (1.0 - (y / softcap) ** 2) if softcap else scale
    return (g * dydz * weight_rows[:, None]).to(z.dtype)


def _backward(grad, hidden, weight, bias, target, scale, softcap, chunk, want):
    n = hidden.shape[0]
    grad_h = torch.empty_like(hidden) if want[0] else None
    grad_w = torch.zeros_like(weight, memory_format=torch.contiguous_format) if want[1] else None
    grad_b = torch.zeros_like(bias, dtype=torch.float32) if want[2] else None
    kernel = use_triton(hidden)
    buf = torch.empty((min(chunk, n), weight.shape[0]), dtype=hidden.dtype, device=hidden.device) if kernel else None
    scratch = torch.empty(n, dtype=torch.float32, device=hidden.device) if kernel else None
    neg = grad.float().neg().contiguous()  # d logprob = -d cross-entropy
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        h = hidden[s:e]
        if kernel:
            g = _chunk_logits(h, weight, bias, buf[:e - s])
            cross_entropy_grad_(g, target[s:e], _NO_IGNORE, scale, softcap, losses=scratch[s:e], row_scale=neg[s:e])
        else:
            g = _weighted_grad_torch(_chunk_logits(h, weight, bias), target[s:e], scale, softcap, -neg[s:e])
        if grad_h is not None:
            torch.mm(g, weight.to(g.dtype), out=grad_h[s:e])
        if grad_w is not None:
            grad_w.addmm_(g.t(), h)
        if grad_b is not None:
            grad_b += g.float().sum(0)
    return grad_h, grad_w, None if grad_b is None else grad_b.to(bias.dtype)


class _FusedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, scale, softcap, chunk):
        ctx.save_for_backward(hidden, weight, bias, target)
        ctx.params = (scale, softcap, chunk)
        return _forward(hidden, weight, bias, target, scale, softcap, chunk)

    @staticmethod
    @once_differentiable  # kernels, not torch ops: create_graph=True raises, never a silent zero
    def backward(ctx, grad):
        hidden, weight, bias, target = ctx.saved_tensors
        grads = _backward(grad, hidden, weight, bias, target, *ctx.params, ctx.needs_input_grad[:3])
        return (*grads, None, None, None, None)


def fused_linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                          scale: float = 1.0, softcap: float | None = None,
                          chunk_size: int | None = None) -> torch.Tensor:
    """log softmax(transform(hidden @ weight.T + bias))[r, target[r]] per row: float32 [N], differentiable.

    hidden [N, H], weight [V, H] and bias [V] (or None) of one float dtype, target int64 [N] in [0, V).
    ``scale`` / ``softcap``: the transform in the module docstring (1.0 / None: raw logits). Gradients flow
    to hidden, weight and bias, weighted per row by the incoming gradient. ``chunk_size`` rows per chunk
    (None: :func:`fxrewrite.kernels.fused_linear_cross_entropy.default_chunk_size`). On CUDA (or under the
    Triton interpreter with FXREWRITE_TRITON=1) the cross-entropy kernel runs; otherwise the torch closed
    form. Peak extra memory: one chunk of logits, plus d/dweight [V, H] in the backward. ValueError on
    mismatched shapes or dtypes."""
    chunk = _checked_chunk("fused_linear_logprobs", hidden, weight, bias, target, chunk_size)
    if functorch_active():  # torch.func transforms torch ops, not the Function: the reference
        return fused_linear_logprobs_ref(hidden, weight, bias, target, scale, softcap)
    return _FusedLinearLogprobs.apply(hidden, weight, bias, target, float(scale), softcap, chunk)


def _chunk_loss_grads(z, t, scale, softcap, kernel, token_loss, lps, s, e):
    """One chunk of `fused_linear_token_loss`'s forward: its logprobs into lps[s:e], then (dL/dz [C, V] in z's
    dtype, a float32 [C] factor per row still to apply to it or None, the chunk's summed loss)."""
    if kernel:  # the kernel writes each row's cross-entropy, and d(cross-entropy)/dz over z in place
        cross_entropy_grad_(z, t, _NO_IGNORE, scale, softcap, losses=lps[s:e])
        lps[s:e].neg_()
    else:
        y = _transform(z, scale, softcap)
        lps[s:e] = y.gather(1, t[:, None]).squeeze(1) - torch.logsumexp(y, dim=-1)
    lp = lps[s:e].clone().requires_grad_()
    with torch.enable_grad():  # dL/dlogprob per token, by autograd through the caller's elementwise loss
        part = token_loss(lp, s, e)
        (w,) = torch.autograd.grad(part.sum(), lp)
    if kernel:
        return z, w.neg(), part.detach().sum()  # d logprob = -d cross-entropy
    return _weighted_grad_torch(z, t, scale, softcap, w), None, part.detach().sum()


def _forward_with_grads(hidden, weight, bias, target, token_loss, scale, softcap, chunk, want):
    n = hidden.shape[0]
    lps = torch.empty(n, dtype=torch.float32, device=hidden.device)
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_h = torch.empty_like(hidden) if want[0] else None
    grad_w = torch.zeros_like(weight, memory_format=torch.contiguous_format) if want[1] else None
    grad_b = torch.zeros_like(bias, dtype=torch.float32) if want[2] else None
    kernel = use_triton(hidden)
    buf = torch.empty((min(chunk, n), weight.shape[0]), dtype=hidden.dtype, device=hidden.device) if kernel else None
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        h = hidden[s:e]
        z = _chunk_logits(h, weight, bias, buf[:e - s] if kernel else None)
        g, row, part = _chunk_loss_grads(z, target[s:e], scale, softcap, kernel, token_loss, lps, s, e)
        loss += part
        if grad_h is not None:  # the row factor in float32, then one rounding to the hidden dtype
            gh = torch.mm(g, weight.to(g.dtype))
            grad_h[s:e] = gh if row is None else (gh.float() * row[:, None]).to(hidden.dtype)
        if grad_w is not None:
            grad_w.addmm_(g.t(), h if row is None else (h.float() * row[:, None]).to(h.dtype))
        if grad_b is not None:
            grad_b += g.float().sum(0) if row is None else (g.float() * row[:, None]).sum(0)
    return loss, lps, (grad_h, grad_w, None if grad_b is None else grad_b.to(bias.dtype))


class _FusedLinearTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, token_loss, scale, softcap, chunk):
        loss, lps, grads = _forward_with_grads(hidden, weight, bias, target, token_loss, scale, softcap, chunk,
                                               ctx.needs_input_grad[:3])
        ctx.grads = grads
        ctx.mark_non_differentiable(lps)
        return loss, lps

    @staticmethod
    @once_differentiable  # kernels, not torch ops: create_graph=True raises, never a silent zero
    def backward(ctx, grad_loss, _grad_lps):
        # in place, as the fused linear cross-entropy's backward (no second copy of d weight)
        grads = [None if g is None else g.mul_(grad_loss) for g in ctx.grads]
        ctx.grads = None
        return (*grads, None, None, None, None, None)


def fused_linear_token_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            target: torch.Tensor, token_loss, scale: float = 1.0, softcap: float | None = None,
                            chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over rows of a per-token loss of the target logprobs, the logprobs) with the gradients made in the
    forward: float32 0-d (differentiable) and float32 [N] (no gradient).

    ``token_loss(logprobs, start, stop)`` maps a chunk's float32 logprobs [stop - start] (rows start..stop-1)
    to their losses [stop - start], each row's from its own logprob only (elementwise: a GRPO/PPO clipped
    ratio against per-token constants it indexes by the slice). Its derivative per row, by autograd on the
    chunk, weights the softmax gradient while the chunk's logits are still there: three GEMMs per chunk
    (logits, d hidden, d weight) instead of :func:`fused_linear_logprobs` + a loss's four (its backward
    recomputes the logits), Liger-Kernel's fused linear cross-entropy trick extended to any elementwise loss
    of the logprob. Gradients ([N, H], [V, H], [V]) are held from the forward to the backward, which scales
    them by the incoming scalar. Shapes, dtypes, ``scale``/``softcap``/``chunk_size`` and errors as
    :func:`fused_linear_logprobs`; under torch.func
    transforms the torch reference runs (unchunked)."""
    chunk = _checked_chunk("fused_linear_token_loss", hidden, weight, bias, target, chunk_size)
    if functorch_active():  # torch.func transforms torch ops, not the Function: the reference, one chunk
        lps = fused_linear_logprobs_ref(hidden, weight, bias, target, scale, softcap)
        return token_loss(lps, 0, hidden.shape[0]).sum(), lps.detach()
    return _FusedLinearTokenLoss.apply(hidden, weight, bias, target, token_loss, float(scale), softcap, chunk)


def _checked_chunk(name: str, hidden, weight, bias, target, chunk_size: int | None) -> int:
    """The rows per chunk, after the shape and dtype checks both entry points share (ValueError naming ``name``)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or target.shape != hidden.shape[:1]:
        raise ValueError(f"{name}: hidden {tuple(hidden.shape)} must be [N, H], weight "
                         f"{tuple(weight.shape)} [V, H], target {tuple(target.shape)} [N]")
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(f"{name}: hidden {hidden.dtype}, weight {weight.dtype} and bias "
                         f"{None if bias is None else bias.dtype} must share one dtype")
    return chunk_size or default_chunk_size(hidden.shape[0], weight.shape[0], hidden.shape[1])
