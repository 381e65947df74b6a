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

Under torch.compile the same: the identity function and the deferring loss run outside the compiled graphs, as two
graph breaks (``torch.compiler.disable``: the embedding hook's :func:`_attach`, which makes the call's job, and the
loss's ``LMHeadCrossEntropy._eager``, which reads it when it runs, so no graph guards a per-call object); the
decoder layers and the final norm stay one compiled graph between them. Dynamo counts each break once per frame it
unwinds (torch 2.13: ``_attach`` 6 times, ``_eager`` 2; torch 2.11: 4 and 2). ``FXREWRITE_DEFER_HEAD_GRAD=0`` turns
the deferral off (the gradient made in the loss's forward, as before, to measure one against the other); under
torch.compile the loss is then the custom op with no graph break. Dynamo reads the switch while tracing, as a
constant: changing it takes a new compile (``torch._dynamo.reset()``); ``torch.compile(fullgraph=True)`` needs it
(dynamo raises at the first break, naming the switch). Only a training call with labels defers (one without, e.g.
an RL loss on the logits, is left alone: no graph break); one that does not run its embedding module
(``inputs_embeds`` given) does not either (the loss, eager, makes the gradient in its forward).
"""

from __future__ import annotations

import inspect
import os

import torch
from torch import nn

from fxrewrite.kernels import functorch_active
from fxrewrite.kernels.fused_linear_cross_entropy import forward_with_grads

__all__ = ["ATTACH_BREAK", "DeferredHeadGrad", "head_deferrable", "install_deferred_head_grad"]

# graph-break reason (torch.compile(fullgraph=True) raises it: the deferral needs its breaks)
ATTACH_BREAK = ("fxrewrite: the deferred LM-head gradient's identity on the embedding output "
                "(FXREWRITE_DEFER_HEAD_GRAD=0: no deferral, no graph break)")


SECOND_ORDER_ERROR = (
    "fxrewrite: backward with create_graph=True (second-order gradients) through the LM head's deferred weight "
    "gradient, which is made without a graph; set FXREWRITE_DEFER_HEAD_GRAD=0 before the forward (the fused loss "
    "then differentiates twice), or optimize with patterns= leaving out LMHeadLossPattern")


def plain_parameter(weight) -> bool:
    """A plain ``nn.Parameter`` (not a DTensor of FSDP2 or another subclass): the only weight deferred."""
    return type(weight) is nn.Parameter


class DeferredHeadGrad:
    """One model call's pending head-gradient job: ``attached`` while the call's loss may still claim it; ``args``
    (set by the loss) what the recomputation needs, their hidden states only from the loss's backward until the
    embedding's (so a retained graph's second backward, which runs the loss's backward again, re-arms it); ``scale``
    the loss's gradient."""

    __slots__ = ("attached", "args", "scale")

    def __init__(self):
        self.attached, self.args, self.scale = False, None, None

    def claim(self, hidden, weight, target, ignore_index, transform, kernel_params, chunk) -> bool:
        """Called by the loss: whether the weight gradient is deferred to this job (then the loss must not make
        it, and must pass its result and `hidden` through :class:`ScaleRecorder`)."""
        if not self.attached or self.args is not None:
            return False
        self.attached = False  # one loss per call: a second one makes its own gradient
        self.args = (None, weight, target, ignore_index, transform, kernel_params, chunk)
        return True


class ScaleRecorder(torch.autograd.Function):
    """Identity on the summed loss whose backward hands the job the incoming gradient (the 1 / num_items scale) and
    the hidden states it keeps for it (``forward(total, hidden, job)``)."""

    @staticmethod
    def forward(ctx, total, hidden, job):
        ctx.job = job
        ctx.save_for_backward(hidden)
        return total.view_as(total)

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():  # the deferred gradient is made without a graph: wrong second-order terms
            raise RuntimeError(SECOND_ORDER_ERROR)
        (hidden,) = ctx.saved_tensors
        ctx.job.scale = grad.detach()
        ctx.job.args = (hidden, *ctx.job.args[1:])
        return grad, None, None


class _HeadGradAfterLayers(torch.autograd.Function):
    """Identity on the embedding output; its backward returns the head weight's deferred gradient."""

    @staticmethod
    def forward(ctx, embeds, weight, job):
        ctx.job = job
        return embeds.view_as(embeds)

    @staticmethod
    def backward(ctx, grad):
        job = ctx.job
        if job.args is None or job.args[0] is None or job.scale is None or not ctx.needs_input_grad[1]:
            return grad, None, None  # no loss claimed the job, or this backward did not run the loss's
        hidden, weight, target, ignore_index, transform, kernel_params, chunk = job.args
        job.args = (None, *job.args[1:])  # the hidden states die with this backward (a retained graph keeps its own)
        _, _, grad_w, _ = forward_with_grads(hidden, weight, None, target, ignore_index, transform, kernel_params,
                                             chunk, False, True, False)
        return grad, grad_w.mul_(job.scale.to(grad_w.dtype)), None


def defer_enabled() -> bool:
    """``FXREWRITE_DEFER_HEAD_GRAD`` is not "0". Under torch.compile dynamo reads it while tracing, as a constant:
    changing it needs a new compile (``torch._dynamo.reset()``)."""
    return os.environ.get("FXREWRITE_DEFER_HEAD_GRAD") != "0"


def head_deferrable(head) -> bool:
    """The head whose weight gradient can be deferred: a plain ``nn.Linear`` without bias whose weight (a plain
    parameter) wants a gradient, with autograd on, the switch not off and no torch.func transform running. Static
    under torch.compile (guarded)."""
    return (defer_enabled() and torch.is_grad_enabled() and type(head) is nn.Linear and head.bias is None
            and plain_parameter(head.weight) and head.weight.requires_grad and not functorch_active())


@torch.compiler.disable(reason=ATTACH_BREAK)
def _attach(loss: nn.Module, embeds: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """This call's job on ``loss.deferred`` and the embedding output through :class:`_HeadGradAfterLayers`, unless
    this call already attached one (an embedding run twice)."""
    if loss.deferred is not None:
        return embeds
    job = loss.deferred = DeferredHeadGrad()
    job.attached = True
    return _HeadGradAfterLayers.apply(embeds, weight, job)


def install_deferred_head_grad(model: nn.Module, loss: nn.Module) -> bool:
    """Hooks on ``model`` (a ``*ForCausalLM``, with `loss` as a child) and its input embedding: each call clears
    ``loss.deferred`` and sets ``loss.armed`` (training, labels given) and ``loss.tuple_output`` (return_dict off: the
    tuple keeps logits); in an armed call whose head is deferrable (:func:`head_deferrable`) the embedding's run makes
    a fresh :class:`DeferredHeadGrad` there and puts its output through the identity function. A call without labels
    is left alone (no graph break under torch.compile). The hooks are objects (a pickled model keeps them). True if
    installed."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(embedding, nn.Module):
        return False
    names = list(inspect.signature(model.forward).parameters)
    at = names.index("labels") if "labels" in names else None  # labels passed by position, rarely
    loss_name = next(name for name, child in model.named_children() if child is loss)
    model.register_forward_pre_hook(_Arm(at, loss_name), with_kwargs=True)
    embedding.register_forward_hook(_Attach(model, loss))
    return True


class _Arm:
    """The model's forward pre-hook: this call's state on its loss module."""

    def __init__(self, labels_at: int | None, loss_name: str):
        self.labels_at, self.loss_name = labels_at, loss_name

    def __call__(self, module, args, kwargs):
        at = self.labels_at
        labels = kwargs.get("labels", args[at] if at is not None and at < len(args) else None)
        state = getattr(module, self.loss_name)  # an nn.DataParallel replica's own copy for a replica
        state.deferred, state.armed = None, module.training and labels is not None
        return_dict = kwargs.get("return_dict")  # as transformers' can_return_tuple reads it
        state.tuple_output = not (getattr(module.config, "return_dict", True) if return_dict is None else return_dict)


class _Attach:
    """The input embedding's forward hook: the deferred job on an armed call's embedding output."""

    def __init__(self, model: nn.Module, loss: nn.Module):
        self.model, self.loss = model, loss

    def __call__(self, module, args, output):
        if getattr(module, "_is_replica", False):
            return None  # an nn.DataParallel replica's weights are not Parameters: nothing to defer
        head = self.model.get_output_embeddings()
        if self.loss.armed and isinstance(output, torch.Tensor) and head_deferrable(head):
            return _attach(self.loss, output, head.weight)
        return None
