"""LM head + causal-LM loss without logits: what the `lm_head_loss` pattern calls in a rewritten ``*ForCausalLM``.

Semantics are transformers' ``ForCausalLMLoss`` (``transformers/loss/loss_utils.py``): labels are shifted
left by one (padded with ``ignore_index``) unless ``shift_labels`` is given; the loss is the mean of
the token cross-entropies over targets other than ``ignore_index`` (-100), or their sum divided by
``num_items_in_batch`` when that is given (gradient accumulation). The logits' transform (Gemma 2's
soft-capping, Granite's / Cohere's scaling) is the model's own code, applied per chunk.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from fxrewrite.kernels.fused_linear_cross_entropy import default_chunk_size, fused_linear_cross_entropy
from fxrewrite.kernels.fused_linear_cross_entropy_op import fused_linear_cross_entropy_op
from fxrewrite.layers.deferred_head_grad import ScaleRecorder, head_deferrable
from fxrewrite.layers.fold_guard import unhooked

__all__ = ["LOSS_BREAK", "LMHeadCrossEntropy"]

_MISSING = object()
_TARGET_DTYPES = (torch.int64, torch.uint8)  # the class-index targets F.cross_entropy takes
LOSS_BREAK = ("fxrewrite: the chunked loss, eager (the deferred LM-head gradient, FXREWRITE_DEFER_HEAD_GRAD=0 for "
              "none; or a logits transform other than scaling / soft-capping)")  # graph-break reason


def _divide(total: torch.Tensor, denominator: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``total / denominator`` (0-dim tensors), with stock's gradient when no target counts (`valid`, the number of
    targets other than ``ignore_index``, is 0): the loss is NaN (0 / 0) as stock's, but every gradient is 0, as
    stock's cross-entropy backward writes nothing for an ignored row, not ``0 * (1 / 0)`` = NaN in every parameter
    (a batch whose labels are all -100 would poison the model at the optimizer's step). No host sync."""
    some = valid > 0
    safe = torch.where(some, denominator, torch.ones_like(denominator))
    return torch.where(some, total / safe, total.detach() / denominator)


class LMHeadCrossEntropy(nn.Module):
    """``forward(hidden_states, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
    shift_labels=None, *, head, transform=None) -> loss`` (float32 scalar).

    hidden_states [B, S, H] (the tensor the LM head would read), labels int64 [B, S]; ``head`` is the
    model's ``nn.Linear`` LM head (its weight may be tied to the embedding), ``transform`` maps logits
    to the logits the loss reads (None: identity). ``kernel_params`` = (scale, softcap or None) when the
    transform was proved to be that (enables the Triton cross-entropy on CUDA). ``chunk_size``: rows per
    chunk (None: ``default_chunk_size``, given ``intermediate_size`` when the model checkpoints its
    layers). Under ``torch.compile`` the loss runs eagerly (one graph break, ``_eager``) when the head's weight
    gradient may be deferred (:mod:`fxrewrite.layers.deferred_head_grad`: this call's job is read when it runs) or
    the transform is not ``kernel_params``; otherwise it is the custom op ``fxrewrite::fused_linear_cross_entropy``
    (no graph break; ``FXREWRITE_DEFER_HEAD_GRAD=0`` with no transform or a proved one).
    """

    def __init__(self, kernel_params: tuple[float, float | None] | None = None, chunk_size: int | None = None,
                 intermediate_size: int | None = None, depends: tuple = ()):
        super().__init__()
        self.kernel_params = kernel_params
        self.depends = depends
        """((attribute path from the model, value), ...): what the logits transform read when `kernel_params` was
        proven (``("config", "logits_scaling")``); while they hold, so does the proof (`params_for`)."""
        self.current_params = kernel_params  # `params_for` of this call's model (set by ``fuses``)
        self.chunk_size = chunk_size
        self.intermediate_size = intermediate_size  # the MLP's, for the chunk rule under checkpointing
        self.checkpointing = False  # whether the model checkpoints its layers (read by ``fuses`` each call)
        self.deferred = None  # this call's DeferredHeadGrad (set by the hooks of `install_deferred_head_grad`)
        self.armed = False  # whether this call may defer it (set by the same hooks: training, labels given)
        self.tuple_output = False  # whether this call returns a tuple (return_dict off; set by the same hooks)

    def __getstate__(self) -> dict:
        """A copy (pickle, deepcopy) leaves the last call's deferred job out: it holds that call's hidden states,
        labels and logits transform (a local function pickle cannot store); the next call makes its own."""
        state = dict(super().__getstate__())
        state["deferred"] = None
        return state

    def fuses(self, model: nn.Module, labels, hidden_states, head, shift_labels=None) -> bool:
        """Whether this call takes the fused path: labels given, the model training with autograd on, a
        ModelOutput asked for (``return_dict`` not off), the loss still transformers' ``ForCausalLMLoss``, a plain
        ``nn.Linear`` head without hooks (PEFT / tensor-parallel wrappers and a head hooked after optimize keep the
        stock path), and labels shaped like the tokens with targets of a dtype torch's cross-entropy takes (int64,
        uint8; an int32 or bool target is its error) (else the stock path raises the stock error). Notes whether the
        base model checkpoints its layers (the chunk size follows)."""
        if labels is None or not (model.training and torch.is_grad_enabled()) or self.tuple_output:
            return False  # a tuple has no field names: without its logits every later element would move up
        if type(head) is not nn.Linear or type(head.weight) not in (nn.Parameter, torch.Tensor):  # Tensor: a replica's
            return False
        if not unhooked(head):  # a hook put on the head after optimize sees its call (the logits), as in stock
            return False
        if model.loss_function is not ForCausalLMLoss:
            return False
        base = getattr(model, getattr(model, "base_model_prefix", ""), model)
        self.checkpointing = bool(getattr(base, "gradient_checkpointing", False))
        self.current_params = self.params_for(model)
        tokens = tuple(hidden_states.shape[:-1])
        ok = isinstance(labels, torch.Tensor) and not labels.is_floating_point() and tuple(labels.shape) == tokens
        if shift_labels is not None:
            ok = ok and isinstance(shift_labels, torch.Tensor) and tuple(shift_labels.shape) == tokens
        return ok and (labels if shift_labels is None else shift_labels).dtype in _TARGET_DTYPES

    def params_for(self, model: nn.Module) -> tuple[float, float | None] | None:
        """`kernel_params` while every value in `depends` is still what it was when the transform was proven; None
        once one changed (the config edited after optimize: then the model's own transform runs, on the logits)."""
        if self.kernel_params is None:
            return None
        for path, value in self.depends:
            current = model
            for name in path:
                current = getattr(current, name, _MISSING)
            if current is _MISSING or type(current) is not type(value) or current != value:
                return None
        return self.kernel_params

    def forward(self, hidden_states, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                shift_labels=None, *, head: nn.Linear, transform: Callable | None = None, **kwargs):
        if head.out_features != vocab_size:
            raise ValueError(f"LM head has {head.out_features} outputs, expected vocab_size {vocab_size}")
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
        target = shift_labels.reshape(-1).to(hidden.device)
        # under checkpointing the layers' recomputed backward outlives the loss: larger chunks, same peak
        inter = self.intermediate_size if self.checkpointing else None
        if (torch.compiler.is_compiling() and (transform is None or self.current_params is not None)
                and not (self.armed and head_deferrable(head))):
            # the custom op: one opaque node in the compiled graph (no graph break, no logits)
            scale, softcap = self.current_params or (1.0, None)
            total = fused_linear_cross_entropy_op(hidden, head.weight, head.bias, target, ignore_index, scale,
                                                  softcap, self.chunk_size, inter)
        else:
            total = self._eager(hidden, head, target, ignore_index, transform, inter)
        valid = (target != ignore_index).sum()
        if num_items_in_batch is None:
            return _divide(total, valid, valid)
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return _divide(total, torch.as_tensor(num_items_in_batch, device=total.device), valid)

    # under torch.compile one graph break: dynamo cannot trace the chunk loop (it computes gradients in the
    # forward), a transform other than scaling / soft-capping does not fit the custom op's schema, and this
    # call's deferred-gradient job (a Python object made per call) is read here when it runs, not guarded
    @torch.compiler.disable(reason=LOSS_BREAK)
    def _eager(self, hidden, head, target, ignore_index, transform, inter):
        """The chunked loss; the head's weight gradient deferred to the embedding's backward when this call's
        job (:mod:`fxrewrite.layers.deferred_head_grad`) takes it."""
        job, weight = self.deferred, head.weight
        if job is not None and head.bias is None and weight.requires_grad and torch.is_grad_enabled():
            chunk = self.chunk_size or default_chunk_size(hidden.shape[0], weight.shape[0], hidden.shape[1],
                                                          intermediate=inter)
            if job.claim(hidden, weight, target, ignore_index, transform, self.current_params, chunk):
                total = fused_linear_cross_entropy(hidden, weight.detach(), None, target, ignore_index, transform,
                                                   self.current_params, chunk, inter)
                return ScaleRecorder.apply(total, hidden.detach(), job)
        return fused_linear_cross_entropy(hidden, weight, head.bias, target, ignore_index, transform,
                                          self.current_params, self.chunk_size, inter)

    def extra_repr(self) -> str:
        """Kernel parameters and chunk size in the module's repr."""
        return (f"kernel_params={self.kernel_params}, chunk_size={self.chunk_size}, "
                f"intermediate_size={self.intermediate_size}")
