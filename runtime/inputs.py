"""Flatten a scheduled step into model inputs: token ids, positions and attention metadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxrewrite.runtime.forward_context import AttentionMetadata
from fxrewrite.runtime.scheduler import ScheduledSeq


@dataclass
class StepInputs:
    """Model inputs of one step.

    input_ids, positions [T] int64; logits_indices [S] int64: index in the flattened batch of the last
    token of each sequence that samples this step; sample_seqs: those S sequences, in the same order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_seqs: list


def prepare_inputs(scheduled: list[ScheduledSeq], block_size: int, device: torch.device) -> StepInputs:
    """Concatenate this step's tokens of every scheduled sequence (decodes and prefill chunks alike)."""
    input_ids, positions, slot_mapping, seq_lens, query_start_loc = [], [], [], [], [0]
    logits_indices, sample_seqs = [], []
    for s in scheduled:
        seq, start, end = s.seq, s.start, s.start + s.num_new_tokens
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        table = seq.block_table
        slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        seq_lens.append(end)
        query_start_loc.append(query_start_loc[-1] + s.num_new_tokens)
        if s.samples:
            logits_indices.append(query_start_loc[-1] - 1)
            sample_seqs.append(seq)
    max_blocks = max(len(s.seq.block_table) for s in scheduled)
    block_tables = [s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table)) for s in scheduled]

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    metadata = AttentionMetadata(
        slot_mapping=tensor(slot_mapping, torch.int64),
        block_tables=tensor(block_tables, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        query_start_loc=tensor(query_start_loc, torch.int32),
        max_query_len=max(s.num_new_tokens for s in scheduled),
        max_seq_len=max(seq_lens),
    )
    return StepInputs(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        attn_metadata=metadata,
        logits_indices=tensor(logits_indices, torch.int64),
        sample_seqs=sample_seqs,
    )
