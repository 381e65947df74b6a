"""What the scheduler must do for RoPE types whose frequencies depend on a sequence's length.

Each token's RoPE length is max(seq.rope_prefill_len, position + 1) (see `Sequence.rope_prefill_len`);
the model runner passes it per token, so a sequence's numerics never depend on its batch neighbours.
Two consequences for scheduling, both matching transformers' cached generation for one sequence:

- LongRoPE (Phi-3 class): transformers' Phi-3 `prepare_inputs_for_generation` drops the cache the first
  time the sequence grows past original_max_position_embeddings and recomputes it with the long
  factors (`switches`); the scheduler does that by recomputation, like a preemption.
- Prefix caching: a block's K/V depend on rope_prefill_len once it passes the rope's threshold, so the
  block hashes are salted with it there (`hash_salt`) and never shared across the two regimes.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxrewrite.runtime.engine.sequence import Sequence


@dataclass(frozen=True)
class LengthDependentRope:
    """rope_type "dynamic" (threshold: max_position_embeddings, where the NTK base starts to grow) or
    "longrope" (threshold: original_max_position_embeddings, where the long factors take over)."""

    rope_type: str
    threshold: int

    def hash_salt(self, rope_prefill_len: int) -> int | None:
        """None while rope_prefill_len leaves every token's frequencies as without it; else a salt
        (dynamic: the length itself, which sets the base; longrope: -1, every token is long)."""
        if rope_prefill_len <= self.threshold:
            return None
        return -1 if self.rope_type == "longrope" else rope_prefill_len

    def switches(self, seq: Sequence) -> bool:
        """True when a LongRoPE sequence computed with short factors now has more tokens than the threshold."""
        return self.rope_type == "longrope" and seq.rope_prefill_len <= self.threshold < seq.num_tokens


def length_dependent_rope(model_config) -> LengthDependentRope | None:
    """The model's LengthDependentRope, or None for rope types whose frequencies ignore the length."""
    by_layer = getattr(model_config, "rope_parameters_by_layer_type", None) or {}
    for rope in (model_config.rope_parameters, *by_layer.values()):
        if rope["rope_type"] == "longrope":
            return LengthDependentRope("longrope", int(rope["original_max_position_embeddings"]))
        if rope["rope_type"] == "dynamic":
            return LengthDependentRope("dynamic", int(model_config.hf_text_config.max_position_embeddings))
    return None
