"""Qwen3's fused q/k-norm + rotary training kernels as ``torch.library`` custom ops, for ``torch.compile``.

``fxrewrite::qk_norm_rope_train`` (forward) and ``fxrewrite::qk_norm_rope_train_backward`` run the Triton kernels of
:mod:`fxrewrite.kernels.qk_norm_rope_backward` with a fake (meta) implementation and an autograd formula, so a
compiled training step keeps them opaque: the saved tensors are the eager Function's (the inputs q and k, cos, sin,
the weights), not what Inductor's partitioner would pick from the torch reference (the normalised q/k, rstd per
head, the rotated copies). :func:`qk_norm_rope_fused` picks the op while torch.compile traces
(:func:`fxrewrite.kernels.compiled_training_kernels`) and :class:`QKNormRopeFunction` otherwise.
"""

from __future__ import annotations

import torch

from fxrewrite.kernels import compiled_training_kernels
from fxrewrite.kernels.qk_norm_rope_backward import QKNormRopeFunction, _bshd, qk_backward, qk_forward

__all__ = ["qk_norm_rope_fused"]


@torch.library.custom_op("fxrewrite::qk_norm_rope_train", mutates_args=())
def _qk_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
           k_weight: torch.Tensor, q_eps: float, k_eps: float, is_neox_style: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return qk_forward(q, k, cos, sin, q_weight, k_weight, q_eps, k_eps, is_neox_style)


@_qk_op.register_fake
def _(q, k, cos, sin, q_weight, k_weight, q_eps, k_eps, is_neox_style):
    return _bshd(q), _bshd(k)


@torch.library.custom_op("fxrewrite::qk_norm_rope_train_backward", mutates_args=())
def _qk_backward_op(dq: torch.Tensor, dk: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, q_eps: float, k_eps: float,
                    is_neox_style: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return qk_backward(dq, dk, q, k, cos, sin, q_weight, k_weight, q_eps, k_eps, is_neox_style)


@_qk_backward_op.register_fake
def _(dq, dk, q, k, cos, sin, q_weight, k_weight, q_eps, k_eps, is_neox_style):
    d = q.shape[-1]
    return _bshd(q), _bshd(k), q.new_empty(d, dtype=torch.float32), q.new_empty(d, dtype=torch.float32)


def _setup(ctx, inputs, output):
    q, k, cos, sin, q_weight, k_weight, q_eps, k_eps, is_neox_style = inputs
    ctx.save_for_backward(q, k, cos, sin, q_weight, k_weight)
    ctx.args = (float(q_eps), float(k_eps), bool(is_neox_style))


def _backward(ctx, dq, dk):
    q, k, cos, sin, q_weight, k_weight = ctx.saved_tensors
    dq = torch.zeros_like(q) if dq is None else dq  # an op takes tensors, never None
    dk = torch.zeros_like(k) if dk is None else dk
    gq, gk, dwq, dwk = torch.ops.fxrewrite.qk_norm_rope_train_backward(dq, dk, q, k, cos, sin, q_weight, k_weight,
                                                                      *ctx.args)
    return (gq, gk, None, None, dwq.to(q_weight.dtype) if ctx.needs_input_grad[4] else None,
            dwk.to(k_weight.dtype) if ctx.needs_input_grad[5] else None, None, None, None)


_qk_op.register_autograd(_backward, setup_context=_setup)


def qk_norm_rope_fused(q, k, cos, sin, q_weight, k_weight, q_eps: float, k_eps: float, is_neox_style: bool = True):
    """Per-head q/k RMSNorm + rotary through the Triton kernels: the custom op while torch.compile traces, else
    :class:`QKNormRopeFunction`. Inputs as :func:`fxrewrite.kernels.qk_norm_rope_backward.qk_norm_rope_train` after
    its :func:`~fxrewrite.kernels.qk_norm_rope_backward.fits` check; returns (q_out, k_out) in q's dtype."""
    if compiled_training_kernels(q):
        return torch.ops.fxrewrite.qk_norm_rope_train(q, k, cos, sin, q_weight, k_weight, float(q_eps), float(k_eps),
                                                      bool(is_neox_style))
    return QKNormRopeFunction.apply(q, k, cos, sin, q_weight, k_weight, q_eps, k_eps, is_neox_style)
