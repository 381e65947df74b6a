"""Flatten a scheduled step into model inputs: token ids, positions and attention metadata."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
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
    """Concatenate this step's tokens of every scheduled sequence (decodes and prefill chunks alike).

    Per-token values (positions, slots) are computed with numpy over the whole batch, and the int64 and
    int32 tensors each travel to the device in one copy (slices of one buffer): a decode step of 256
    sequences costs one Python pass over the sequences, not one per token.
    """
    num_seqs = len(scheduled)
    tables = [s.seq.block_table for s in scheduled]
    starts = np.fromiter((s.start for s in scheduled), dtype=np.int64, count=num_seqs)
    num_new = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
    table_lens = np.fromiter(map(len, tables), dtype=np.int64, count=num_seqs)
    samples = np.fromiter((s.samples for s in scheduled), dtype=bool, count=num_seqs)
    ends = starts + num_new
    cu_new = np.cumsum(num_new)
    num_tokens = int(cu_new[-1])
    max_blocks = int(table_lens.max())

    # int64 buffer: input_ids [T] | positions [T] | slot_mapping [T] | logits_indices [S]
    sample_idx = np.flatnonzero(samples)
    buf64 = np.empty(3 * num_tokens + len(sample_idx), dtype=np.int64)
    input_ids, positions = buf64[:num_tokens], buf64[num_tokens : 2 * num_tokens]
    slot_mapping, logits_indices = buf64[2 * num_tokens : 3 * num_tokens], buf64[3 * num_tokens :]
    ids = itertools.chain.from_iterable(s.seq.token_ids[s.start : s.start + s.num_new_tokens] for s in scheduled)
    input_ids[:] = np.fromiter(ids, dtype=np.int64, count=num_tokens)
    seq_of_token = np.repeat(np.arange(num_seqs), num_new)
    positions[:] = np.arange(num_tokens) + np.repeat(starts - (cu_new - num_new), num_new)
    logits_indices[:] = cu_new[sample_idx] - 1

    # int32 buffer: block_tables [B, max_blocks] (padded with 0) | seq_lens [B] | query_start_loc [B+1]
    buf32 = np.zeros(num_seqs * max_blocks + 2 * num_seqs + 1, dtype=np.int32)
    block_tables = buf32[: num_seqs * max_blocks].reshape(num_seqs, max_blocks)
    flat_tables = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(table_lens.sum()))
    block_tables[np.arange(max_blocks)[None, :] < table_lens[:, None]] = flat_tables
    seq_lens = buf32[num_seqs * max_blocks : num_seqs * max_blocks + num_seqs]
    seq_lens[:] = ends
    query_start_loc = buf32[num_seqs * max_blocks + num_seqs :]
    query_start_loc[1:] = cu_new
    slot_mapping[:] = block_tables[seq_of_token, positions // block_size].astype(np.int64) * block_size + (
        positions % block_size
    )

    t64 = torch.from_numpy(buf64).to(device, non_blocking=True)
    t32 = torch.from_numpy(buf32).to(device, non_blocking=True)
    nb = num_seqs * max_blocks
    metadata = AttentionMetadata(
        slot_mapping=t64[2 * num_tokens : 3 * num_tokens],
        block_tables=t32[:nb].view(num_seqs, max_blocks),
        seq_lens=t32[nb : nb + num_seqs],
        query_start_loc=t32[nb + num_seqs :],
        max_query_len=int(num_new.max()),
        max_seq_len=int(ends.max()),
    )
    return StepInputs(
        input_ids=t64[:num_tokens],
        positions=t64[num_tokens : 2 * num_tokens],
        attn_metadata=metadata,
        logits_indices=t64[3 * num_tokens :],
        sample_seqs=[scheduled[i].seq for i in sample_idx.tolist()],
    )
