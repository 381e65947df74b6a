"""Per-step attention metadata, set by the model runner and read by the attention layers.

Keeps the model's forward narrow (input ids and positions): the paged-attention function registered in
transformers and the native `Attention` layer both read the slot mapping, block tables and KV caches from
here instead of from arguments.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from fxrewrite.layers.kv_context import set_kv_step


@dataclass
class AttentionMetadata:
    """Flattened-batch attention inputs of one step (T tokens of B sequences).

    slot_mapping [T] int64: cache slot (block_id * block_size + offset) each token's K/V is written to.
    block_tables [B, max_blocks] int32; seq_lens [B] int32 (context length including this step's
    tokens); query_start_loc [B+1] int32 (offsets of each sequence's tokens in the flattened batch).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """Per layer: (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim]."""


_context: AttentionMetadata | None = None


def set_forward_context(metadata: AttentionMetadata | None) -> None:
    global _context
    _context = metadata
    set_kv_step(metadata)  # fused layers of a rewritten model may write the step's K/V (fxrewrite.layers.kv_context)


def get_forward_context() -> AttentionMetadata:
    """The current step's metadata; RuntimeError outside a model runner step."""
    if _context is None:
        raise RuntimeError(
            "no forward context: fxrewrite paged attention runs only inside the engine's model runner step"
        )
    return _context


def reset_forward_context() -> None:
    set_forward_context(None)


@contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Set the metadata for the duration of a forward pass; always reset, also on errors."""
    set_forward_context(metadata)
    try:
        yield metadata
    finally:
        reset_forward_context()
