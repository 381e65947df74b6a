"""The fused linear cross-entropy as a ``torch.library`` custom op, for ``torch.compile``.

Dynamo cannot trace the chunk loop of :mod:`fxrewrite.kernels.fused_linear_cross_entropy` (it computes
gradients inside the forward), and Inductor, given the torch reference, would materialise the
[tokens, vocab] logits. Registered as ``fxrewrite::fused_linear_cross_entropy`` with a fake (meta)
implementation and an autograd formula, the loss stays one opaque node in the compiled graph: no graph
break, Inductor fuses the code around it, and the op itself runs eagerly with the Triton cross-entropy
kernel. The op returns the summed loss and the gradients it computed in its forward; the backward
multiplies those by the incoming scalar (out of place: a traced backward may not write its saved inputs).

Only transforms given in numbers (``scale``, ``softcap``; transformers' soft-capping and logit scaling)
fit an op schema; a loss with another transform keeps the eager path (one graph break).
"""

from __future__ import annotations

import torch

from fxrewrite.kernels.fused_linear_cross_entropy import default_chunk_size, forward_with_grads

__all__ = ["fused_linear_cross_entropy_op"]


@torch.library.custom_op("fxrewrite::fused_linear_cross_entropy", mutates_args=())
def _flce(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
          ignore_index: int, scale: float, softcap: float, chunk: int, intermediate: int, want_h: bool,
          want_w: bool, want_b: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    cap = softcap or None
    chunk = chunk or default_chunk_size(hidden.shape[0], weight.shape[0], hidden.shape[1],  # real sizes here
                                        intermediate=intermediate or None)
    # transform None: the chunks take the Triton kernel or its closed form in torch (autograd is off in an op)
    total, gh, gw, gb = forward_with_grads(hidden, weight, bias, target, ignore_index, None, (scale, cap),
                                           chunk, want_h, want_w, want_b)
    empty = hidden.new_empty(0)  # an op returns tensors: an empty one stands for "not wanted"
    return total, (empty if gh is None else gh), (empty if gw is None else gw), (empty if gb is None else gb)


@_flce.register_fake
def _(hidden, weight, bias, target, ignore_index, scale, softcap, chunk, intermediate, want_h, want_w, want_b):
    empty = hidden.new_empty(0)
    return (hidden.new_empty((), dtype=torch.float32), torch.empty_like(hidden) if want_h else empty,
            torch.empty_like(weight) if want_w else empty, torch.empty_like(bias) if want_b else empty)


def _setup_context(ctx, inputs, output):
    ctx.which = inputs[-3:]
    ctx.save_for_backward(*output[1:])


def _backward(ctx, grad_loss, *_unused):
    grads = [g * grad_loss if want else None for g, want in zip(ctx.saved_tensors, ctx.which)]
    return (*grads, None, None, None, None, None, None, None, None, None)


_flce.register_autograd(_backward, setup_context=_setup_context)


def fused_linear_cross_entropy_op(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                  target: torch.Tensor, ignore_index: int = -100, scale: float = 1.0,
                                  softcap: float | None = None, chunk_size: int | None = None,
                                  intermediate_size: int | None = None) -> torch.Tensor:
    """Summed cross-entropy of ``y(hidden @ weight.T + bias)`` against ``target`` (float32 []), where
    ``y = softcap * tanh(scale * z / softcap)``, or ``scale * z`` without ``softcap``; differentiable in
    hidden [N, H], weight [V, H] and bias [V] (or None); target int64 [N]. Same values and gradients as
    :func:`fxrewrite.kernels.fused_linear_cross_entropy.fused_linear_cross_entropy` with that transform.
    ValueError on mismatched shapes."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or target.shape != hidden.shape[:1]:
        raise ValueError(f"fused_linear_cross_entropy_op: hidden {tuple(hidden.shape)} must be [N, H], weight "
                         f"{tuple(weight.shape)} [V, H], target {tuple(target.shape)} [N]")
    grad = torch.is_grad_enabled()
    want = (grad and hidden.requires_grad, grad and weight.requires_grad,
            grad and bias is not None and bias.requires_grad)
    total, *_ = torch.ops.fxrewrite.fused_linear_cross_entropy(hidden, weight, bias, target, ignore_index,
                                                               float(scale), float(softcap or 0.0), chunk_size or 0,
                                                               intermediate_size or 0,
                                                               *want)
    return total
