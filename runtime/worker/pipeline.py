"""Pipeline parallelism: the decoder-layer list split into stages, hidden states sent stage to stage.

A post-hoc transform of the built model (before its weights are materialised), for native models
(``model.model.layers``) and transformers models (``hf_model.base_model.layers``, the list the
rewrite walks) alike. Stage s of P keeps layers [start_s, end_s) (`stage_layers`: an even split, the
earlier stages taking one more when the count does not divide); the other layers become
`PPMissingLayer` (no parameters, their checkpoint tensors are skipped). Stage 0 embeds the tokens;
every later stage's input embedding instead returns the hidden states received from the previous
stage (a static buffer, so CUDA graphs capture it); every stage but the last skips the final norm and
sends its hidden states on; the last stage computes logits and samples.

One tensor crosses each boundary. A native decoder layer returns (hidden, residual) and its successor
first computes hidden + residual (the fused add + RMSNorm), so the sender folds the residual in and
the receiver starts with residual None: the same sum in the same dtype (bit-identical in float32, as
the CPU tests check), with half the traffic of sending both (vLLM sends both). Transformers layers carry the residual inside.
"""

from __future__ import annotations

import os
import types

import torch
import torch.distributed as dist
from torch import nn

from fxrewrite.errors import UserInputError
from fxrewrite import distributed


LAYER_PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"
"""vLLM's variable: the decoder layers of each stage, comma-separated (e.g. "33,31"), summing to the
model's layer count. The default split is even; the last stage also runs the final norm, lm_head and
sampler, so giving it a layer less can balance the stages (the pipeline runs at its slowest stage)."""


def layer_partition(num_layers: int, pp_size: int) -> list[int] | None:
    """The layer counts of `LAYER_PARTITION_ENV`, or None when unset. UserInputError when they are not
    pp_size positive integers summing to num_layers."""
    text = os.environ.get(LAYER_PARTITION_ENV, "").strip()
    if not text:
        return None
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        counts = []
    if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 1:
        raise UserInputError(f"{LAYER_PARTITION_ENV}={text!r}: expected {pp_size} positive layer counts "
                             f"(one per pipeline stage) summing to num_hidden_layers={num_layers}")
    return counts


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """[start, end) of the decoder layers of stage `pp_rank` of `pp_size`: `layer_partition` when set, else
    an even split (earlier stages take one more when the count does not divide).

    Raises ValueError when pp_size exceeds num_layers (a stage would hold no layer) or the partition is bad.
    """
    check_pipeline_size(num_layers, pp_size)
    counts = layer_partition(num_layers, pp_size)
    if counts is not None:
        start = sum(counts[:pp_rank])
        return start, start + counts[pp_rank]
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def check_pipeline_size(num_layers: int, pp_size: int) -> None:
    if not isinstance(pp_size, int) or pp_size < 1:
        raise UserInputError(f"pipeline_parallel_size={pp_size!r} must be a positive integer")
    if pp_size > num_layers:
        raise UserInputError(f"pipeline_parallel_size={pp_size} is larger than the model's num_hidden_layers="
                         f"{num_layers}: every pipeline stage needs at least one decoder layer")


class PPMissingLayer(nn.Module):
    """A decoder layer of another stage: passes its input through (never called in a correct split,
    since the embedding of a later stage already holds the hidden states past it)."""

    def __init__(self, native: bool) -> None:
        super().__init__()
        self.native = native

    def forward(self, *args, **kwargs):
        if self.native:  # (positions, hidden_states, residual) -> (hidden_states, residual)
            return args[1], args[2]
        return args[0] if args else kwargs["hidden_states"]


def _decoder(model: nn.Module) -> tuple[nn.Module, bool]:
    """(the module holding `layers`, `embed_tokens` and `norm`; whether the model is native)."""
    hf = getattr(model, "hf_model", None)
    inner = hf.base_model if hf is not None else getattr(model, "model", None)
    if inner is None or not isinstance(getattr(inner, "layers", None), nn.ModuleList):
        raise UserInputError(f"pipeline parallelism needs the decoder-layer list (model.layers); "
                         f"{type(model).__name__} has none")
    return inner, hf is None


class PipelineStage:
    """This rank's stage: splits the model (`apply`), receives / sends hidden states each step."""

    def __init__(self, pp_rank: int, pp_size: int, pp_ranks: tuple[int, ...], group) -> None:
        self.pp_rank, self.pp_size, self.pp_ranks, self.group = pp_rank, pp_size, pp_ranks, group
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp_size - 1
        self.buffer: torch.Tensor | None = None
        self.layers: tuple[int, int] = (0, 0)

    def apply(self, model: nn.Module, num_layers: int) -> list[str]:
        """Split `model` in place; returns the checkpoint name prefixes of the layers it dropped."""
        inner, native = _decoder(model)
        self.layers = start, end = stage_layers(num_layers, self.pp_size, self.pp_rank)
        dropped = []
        for i in [*range(start), *range(end, len(inner.layers))]:
            inner.layers[i] = PPMissingLayer(native)
            dropped.append(f"model.layers.{i}.")
        if not self.is_first:
            inner.embed_tokens.forward = types.MethodType(_received_hidden(self), inner.embed_tokens)
        if not self.is_last:
            inner.norm.forward = types.MethodType(_fold_residual if native else _identity, inner.norm)
        return dropped

    def allocate(self, max_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """The receive buffer [max_tokens, hidden_size] (static: CUDA graphs read it)."""
        if not self.is_first:
            self.buffer = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)

    def receive(self, num_tokens: int) -> None:
        """Hidden states [num_tokens, hidden] of this step from the previous stage, into the buffer."""
        if not self.is_first:
            dist.recv(self.buffer[:num_tokens], src=self.pp_ranks[self.pp_rank - 1], group=self.group)

    def send(self, hidden: torch.Tensor) -> None:
        """This stage's output [num_tokens, hidden] to the next stage."""
        dist.send(hidden.contiguous(), dst=self.pp_ranks[self.pp_rank + 1], group=self.group)


def pipeline_stage_of_this_rank() -> PipelineStage | None:
    """This worker's `PipelineStage` (from `fxrewrite.distributed`'s state); None without pipeline parallelism."""
    state = distributed.get_state()
    if state is None or state.pp_size == 1 or state.pp_group is None:
        return None
    return PipelineStage(state.pp_rank, state.pp_size, state.pp_ranks, state.pp_group)


def _received_hidden(stage: PipelineStage):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return stage.buffer[: input_ids.numel()].view(*input_ids.shape, stage.buffer.shape[-1])
    return forward


def _fold_residual(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None):
    return (hidden_states if residual is None else hidden_states + residual), None


def _identity(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return hidden_states
