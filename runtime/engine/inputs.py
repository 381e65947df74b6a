"""Flatten a scheduled step into model inputs: token ids, positions and attention metadata."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from fxrewrite.runtime.engine.block_table_cache import BlockTableCache, fill_block_tables
from fxrewrite.runtime.engine.scheduler import ScheduledSeq
from fxrewrite.runtime.worker.forward_context import AttentionMetadata


@dataclass
class StepInputs:
    """Model inputs of one step.

    input_ids, positions [T] int64; rope_lengths [T] int64: each token's RoPE length, max(its
    sequence's rope_prefill_len, position + 1) (fxrewrite.layers.rope_context); logits_indices [S]
    int64: index in the flattened batch of the last token of each sequence that samples this step;
    sample_seqs: those S sequences, in the same order. per_token [3, T] int64: positions, slot_mapping and
    rope_lengths as the rows of one tensor (the others are views of it), for a single copy.
    gather_dst/gather_src [G] int64: tokens still in flight (flat index, row of the previous step's samples);
    gather_in_order: every token is in flight and token i is row i of the previous step's samples (a steady
    decode batch), so the previous step's tokens are this step's input ids as they are.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    rope_lengths: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_seqs: list
    per_token: torch.Tensor | None = None
    gather_dst: torch.Tensor | None = None
    gather_src: torch.Tensor | None = None
    gather_in_order: bool = False


def prepare_inputs(scheduled: list[ScheduledSeq], block_size: int, device: torch.device,
                   previous_rows: dict[int, int] | None = None, table_cache: BlockTableCache | None = None
                   ) -> StepInputs:
    """Concatenate this step's tokens of every scheduled sequence (decodes and prefill chunks alike).

    A sequence whose last token is still pending (sampled by the step in flight) gets a 0 there and a
    gather entry from `previous_rows` (seq_id -> row of that step's samples); RuntimeError if missing, or if a
    sequence's block table does not cover the tokens it is scheduled for (a finished one: an empty table).

    Per-token values (positions, slots) are computed with numpy over the whole batch, and the int64 and
    int32 tensors each travel to the device in one copy (slices of one buffer): a decode step of 256
    sequences costs one Python pass over the sequences, not one per token. `table_cache` (the model runner's)
    keeps the padded block tables between steps, so only blocks appended since the last step are written.
    """
    num_seqs = len(scheduled)
    tables = [s.seq.block_table for s in scheduled]
    starts = np.fromiter((s.start for s in scheduled), dtype=np.int64, count=num_seqs)
    num_new = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
    table_lens = np.fromiter(map(len, tables), dtype=np.int64, count=num_seqs)
    samples = np.fromiter((s.samples for s in scheduled), dtype=bool, count=num_seqs)
    ends, cu_new = starts + num_new, np.cumsum(num_new)
    num_tokens, max_blocks = int(cu_new[-1]), int(table_lens.max())
    _check_tables(scheduled, table_lens, ends, block_size)

    ids, gather = _token_ids(scheduled, ends, cu_new, previous_rows)
    # int64: input_ids [T] | positions [T] | slot_mapping [T] | rope_lengths [T] | logits_indices [S] | gather [2G]
    sample_idx = np.flatnonzero(samples)
    s_end = 4 * num_tokens + len(sample_idx)
    buf64 = np.empty(s_end + 2 * len(gather), dtype=np.int64)
    input_ids, positions, slot_mapping = (buf64[i * num_tokens : (i + 1) * num_tokens] for i in range(3))
    logits_indices = buf64[4 * num_tokens : s_end]
    input_ids[:] = ids if isinstance(ids, np.ndarray) else np.fromiter(ids, dtype=np.int64, count=num_tokens)
    if len(gather):
        buf64[s_end:].reshape(len(gather), 2)[:] = gather
    seq_of_token = np.repeat(np.arange(num_seqs), num_new)
    positions[:] = np.arange(num_tokens) + np.repeat(starts - (cu_new - num_new), num_new)
    logits_indices[:] = cu_new[sample_idx] - 1
    _rope_lengths(scheduled, num_new, positions, out=buf64[3 * num_tokens : 4 * num_tokens])

    buf32, block_tables = _int32_buffer(tables, table_lens, max_blocks, ends, cu_new, table_cache)
    slot_mapping[:] = block_tables[seq_of_token, positions // block_size].astype(np.int64) * block_size + (
        positions % block_size
    )

    t64, t32 = _to_device(buf64, device), _to_device(buf32, device)
    nb = num_seqs * max_blocks
    per_token = t64[num_tokens : 4 * num_tokens].view(3, num_tokens)  # positions, slot_mapping, rope_lengths
    metadata = AttentionMetadata(
        slot_mapping=per_token[1], block_tables=t32[:nb].view(num_seqs, max_blocks), seq_lens=t32[nb : nb + num_seqs],
        query_start_loc=t32[nb + num_seqs :], max_query_len=int(num_new.max()), max_seq_len=int(ends.max()),
    )
    return StepInputs(
        input_ids=t64[:num_tokens], positions=per_token[0], rope_lengths=per_token[2], attn_metadata=metadata,
        logits_indices=t64[4 * num_tokens : s_end],
        sample_seqs=[scheduled[i].seq for i in sample_idx.tolist()],
        per_token=per_token,
        gather_dst=t64[s_end::2] if len(gather) else None,
        gather_src=t64[s_end + 1 :: 2] if len(gather) else None,
        gather_in_order=len(gather) == num_tokens and bool((buf64[s_end::2] == buf64[s_end + 1 :: 2]).all()),
    )


def _check_tables(scheduled: list[ScheduledSeq], table_lens: np.ndarray, ends: np.ndarray, block_size: int) -> None:
    """RuntimeError (a scheduler bug) for a sequence whose blocks do not cover its scheduled tokens: its padding
    would be block 0, another sequence's, so nothing is written through it."""
    short = np.flatnonzero(table_lens * block_size < ends)
    if len(short):
        seq, i = scheduled[int(short[0])].seq, int(short[0])
        raise RuntimeError(f"sequence {seq.seq_id} is scheduled up to token {int(ends[i])} but holds "
                           f"{int(table_lens[i])} blocks of {block_size} (finished: {seq.is_finished})")


def _rope_lengths(scheduled: list[ScheduledSeq], num_new: np.ndarray, positions: np.ndarray, out: np.ndarray) -> None:
    """Each token's RoPE length: max(its sequence's rope_prefill_len, position + 1) (Sequence)."""
    prefill = np.fromiter((s.seq.rope_prefill_len for s in scheduled), dtype=np.int64, count=len(scheduled))
    np.maximum(np.repeat(prefill, num_new), positions + 1, out=out)


def _int32_buffer(tables: list[list[int]], table_lens: np.ndarray, max_blocks: int, ends: np.ndarray,
                  cu_new: np.ndarray, table_cache: BlockTableCache | None) -> tuple[np.ndarray, np.ndarray]:
    """int32 buffer: block_tables [B, max_blocks] (padded with 0) | seq_lens [B] | query_start_loc [B+1];
    returns it and the block_tables view."""
    num_seqs = len(tables)
    nb = num_seqs * max_blocks
    buf32 = np.zeros(nb + 2 * num_seqs + 1, dtype=np.int32)
    block_tables = buf32[:nb].reshape(num_seqs, max_blocks)
    if table_cache is None:
        fill_block_tables(block_tables, tables, table_lens)
    else:
        block_tables[:] = table_cache.update(tables, table_lens)[:, :max_blocks]
    buf32[nb : nb + num_seqs] = ends
    buf32[nb + num_seqs + 1 :] = cu_new
    return buf32, block_tables


def _token_ids(scheduled: list[ScheduledSeq], ends: np.ndarray, cu_new: np.ndarray,
               previous_rows: dict[int, int] | None):
    """The step's token ids (an iterable of T ints, or an array) and [(flat index, previous row)] for pending ones
    (a list of pairs, or an array [G, 2])."""
    host_lens = np.fromiter((len(s.seq.token_ids) for s in scheduled), dtype=np.int64, count=len(scheduled))
    pending = ends > host_lens
    if not pending.any():
        ids = itertools.chain.from_iterable(s.seq.token_ids[s.start : s.start + s.num_new_tokens] for s in scheduled)
        return ids, []
    if previous_rows is not None and int(cu_new[-1]) == len(scheduled) and pending.all():
        # Steady async decode: one token per sequence, each the one in flight. Same as the loop below, with
        # numpy: every input id is 0 and gathered from the previous row; a bad entry goes to the loop's errors.
        rows = [previous_rows.get(s.seq.seq_id) for s in scheduled]
        if None not in rows and bool((ends == host_lens + 1).all()):
            return np.zeros(len(scheduled), dtype=np.int64), np.stack([cu_new - 1, np.array(rows, dtype=np.int64)], 1)
    ids, gather = [], []
    for s, end in zip(scheduled, cu_new.tolist()):
        seq, stop = s.seq, s.start + s.num_new_tokens
        ids += seq.token_ids[s.start : stop]
        if stop > len(seq.token_ids):
            row = None if previous_rows is None else previous_rows.get(seq.seq_id)
            if row is None or stop != len(seq.token_ids) + 1:
                raise RuntimeError(f"sequence {seq.seq_id}: token {stop - 1} is neither on the host nor in flight")
            ids.append(0)
            gather.append((end - 1, row))
    return ids, gather


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array -> device through pinned memory, so the copy neither waits for the GPU nor makes the
    next step wait for this one (torch's caching host allocator reuses the pinned blocks)."""
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
