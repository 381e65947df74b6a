"""The LM head's weight gradient computed after the decoder layers' backward, not held through it.

The fused linear cross-entropy makes d(loss)/d(lm_head.weight) [vocab, hidden] in its forward (Liger-Kernel does the
same). Autograd then holds it through the whole backward: as the head's ``.grad``, or, with tied embeddings, in the
weight's input buffer until the embedding's gradient arrives last. Under activation checkpointing the layers'
backward is where training memory peaks, so that tensor (Qwen3-0.6B: 151936 x 1024 bf16, 297 MiB) sits on the peak.

Here the loss's forward computes d/dhidden only and keeps what the weight gradient needs (the hidden states it read,
[tokens, hidden], the targets, the logits transform); the weight gradient is made by the backward of an identity
function on the embedding output, which autograd runs after every decoder layer's backward and just before the
embedding's own (it is the embedding output's only consumer), by recomputing the logits chunk by chunk
(:func:`fxrewrite.kernels.fused_linear_cross_entropy.forward_with_grads`), scaled by the loss's incoming gradient.
Cost: one more [tokens, hidden] x [hidden, vocab] matmul and cross-entropy pass per step; saving: the [vocab, hidden]
gradient during the layers' backward, less the hidden states kept (Qwen3-0.6B, 8 x 2048 tokens: 297 - 32 MiB).
Gradients flow through autograd as before (DDP's and FSDP's hooks see them when autograd accumulates them).

Eager only: while torch.compile traces, the loss is the custom op and nothing is deferred. A model call that does
not run its embedding module (``inputs_embeds`` given) does not defer either. ``FXREWRITE_DEFER_HEAD_GRAD=0`` turns
it off (the gradient made in the loss's forward, as before), to measure one against the other.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from fxrewrite.kernels.fused_linear_cross_entropy import forward_with_grads

__all__ = ["DeferredHeadGrad", "install_deferred_head_grad"]


def plain_parameter(weight) -> bool:
    """A plain ``nn.Parameter`` (not a DTensor of FSDP2 or another subclass): the only weight deferred."""
    return type(weight) is nn.Parameter


class DeferredHeadGrad:
    """One model call's pending head-gradient job: ``attached`` once the embedding output went through the
    identity function; ``args`` (set by the loss) what the recomputation needs; ``scale`` the loss's gradient."""

    __slots__ = ("attached", "args", "scale")

    def __init__(self):
        self.attached, self.args, self.scale = False, None, None

    def claim(self, hidden, weight, target, ignore_index, transform, kernel_params, chunk) -> bool:
        """Called by the loss: whether the weight gradient is deferred to this job (then the loss must not make
        it, and must pass its incoming gradient through :class:`ScaleRecorder`)."""
        if not self.attached or self.args is not None:
            return False
        self.args = (hidden.detach(), weight, target, ignore_index, transform, kernel_params, chunk)
        return True


class ScaleRecorder(torch.autograd.Function):
    """Identity on the summed loss whose backward records the incoming gradient (the 1 / num_items scale)."""

    @staticmethod
    def forward(ctx, total, job):
        ctx.job = job
        return total.view_as(total)

    @staticmethod
    def backward(ctx, grad):
        ctx.job.scale = grad.detach()
        return grad, None


class _HeadGradAfterLayers(torch.autograd.Function):
    """Identity on the embedding output; its backward returns the head weight's deferred gradient."""

    @staticmethod
    def forward(ctx, embeds, weight, job):
        ctx.job = job
        return embeds.view_as(embeds)

    @staticmethod
    def backward(ctx, grad):
        job, ctx.job = ctx.job, None
        if job.args is None or job.scale is None or not ctx.needs_input_grad[1]:
            return grad, None, None
        hidden, weight, target, ignore_index, transform, kernel_params, chunk = job.args
        job.args = None  # the hidden states die with this call
        _, _, grad_w, _ = forward_with_grads(hidden, weight, None, target, ignore_index, transform, kernel_params,
                                             chunk, False, True, False)
        return grad, grad_w.mul_(job.scale.to(grad_w.dtype)), None


def install_deferred_head_grad(model: nn.Module, loss: nn.Module) -> bool:
    """Hooks on ``model`` (a ``*ForCausalLM``) and its input embedding: each training call with autograd on gets a
    fresh :class:`DeferredHeadGrad` on ``loss.deferred``; the embedding output goes through the identity function
    when the head is a plain ``nn.Linear`` without bias. True if installed."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(embedding, nn.Module):
        return False

    def fresh_job(module, args):
        loss.deferred = (DeferredHeadGrad() if module.training and torch.is_grad_enabled()
                         and not torch.compiler.is_compiling() and os.environ.get("FXREWRITE_DEFER_HEAD_GRAD") != "0"
                         else None)

    def attach(module, args, output):
        job, head = loss.deferred, model.get_output_embeddings()
        if (job is None or job.attached or torch.compiler.is_compiling() or type(head) is not nn.Linear
                or head.bias is not None or not plain_parameter(head.weight) or not head.weight.requires_grad
                or not isinstance(output, torch.Tensor)):
            return None
        job.attached = True
        return _HeadGradAfterLayers.apply(output, head.weight, job)

    model.register_forward_pre_hook(fresh_job)
    embedding.register_forward_hook(attach)
    return True
