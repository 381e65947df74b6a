"""Per-token RoPE lengths of the serving engine's step, for the length-dependent rope types.

Dynamic NTK and LongRoPE choose their frequencies from a sequence length. transformers takes it
as `max(position_ids) + 1` of the forward call, which for a batch of one in cached generation is
the sequence's own length at the step that computed the token. A serving step flattens many
sequences into one row, so that maximum would mix neighbours; the engine instead sets here, for
every token, the length transformers' rotary saw when it computed that token (see
`fxrewrite.runtime.engine.sequence.Sequence.rope_prefill_len`), and `RotaryEmbedding` reads it.

Outside the engine (training, `generate` on an optimized model) nothing is set and the rotary
module behaves as transformers' does: one length for the whole batch, `max(positions) + 1`.
A module global (not an argument) keeps the models' forward signatures unchanged, like the
engine's attention forward context.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

_lengths: torch.Tensor | None = None


def get_rope_lengths(positions: torch.Tensor) -> torch.Tensor | None:
    """The set lengths (int64, viewed as `positions.shape`), or None when none are set.

    Raises ValueError when they do not hold one length per position.
    """
    lengths = _lengths
    if lengths is None:
        return None
    if lengths.numel() != positions.numel():
        raise ValueError(
            f"rope lengths hold {lengths.numel()} values for {positions.numel()} positions "
            f"(shape {tuple(positions.shape)}): set them for exactly this step's tokens"
        )
    return lengths.view(positions.shape)


@contextmanager
def rope_lengths(lengths: torch.Tensor | None) -> Iterator[None]:
    """Set per-token lengths [T] int64 (each >= its position + 1) for the duration of a forward."""
    global _lengths
    previous, _lengths = _lengths, lengths
    try:
        yield
    finally:
        _lengths = previous
