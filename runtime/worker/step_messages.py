"""The driver-to-worker step protocol: `StepEncoder` (driver) packs each scheduled step into a `StepMessage` of flat
int64 arrays carrying only what changed since the last one; `SequenceMirror` (each worker) applies it to its copy of
the running sequences and rebuilds the `SchedulerOutput`; `attach_bitmask` adds a step's grammar mask."""

from __future__ import annotations

import dataclasses

import numpy as np

from fxrewrite.runtime.engine.scheduler import ScheduledSeq, SchedulerOutput
from fxrewrite.runtime.engine.sequence import Sequence


@dataclasses.dataclass
class NewSeq:
    """A sequence the workers have not seen: enough to rebuild it (and its seeded generator)."""

    seq_id: int
    request_id: str
    index: int
    prompt_token_ids: list[int]
    sampling_params: object
    bad_words_token_ids: list[list[int]] = dataclasses.field(default_factory=list)
    """The driver's tokenization of sampling_params.bad_words (the workers' sampler bans them; no tokenizer there)."""


STEP_FIELDS = ("seq_id", "start", "num_new_tokens", "num_pending_tokens", "num_tokens_sent", "table_start",
               "num_blocks_sent", "rope_prefill_len")


@dataclasses.dataclass
class StepMessage:
    """One step, packed in flat int64 arrays (pickling per-sequence objects costs milliseconds at 256
    sequences). `steps` [n, len(STEP_FIELDS)], a row per scheduled sequence: its id, `start` (its
    num_computed_tokens), the chunk length, its tokens in flight, how many host tokens were appended
    since the last message (they follow in `tokens`), and the block-table delta: `blocks` holds
    `num_blocks_sent` ids that replace the table from index `table_start` (0: a whole new table), and
    its `rope_prefill_len`."""

    new: list[NewSeq]
    finished: list[int]
    """seq ids the driver has finished or aborted: the mirrors drop them."""
    steps: np.ndarray
    tokens: np.ndarray
    blocks: np.ndarray
    bitmask: np.ndarray | None = None
    """Structured outputs: the packed allowed-token bits [S, ceil(V/32)] int32 of the step's S sampling rows, in
    the order the workers sample them (`attach_bitmask`); None when no scheduled sequence is constrained."""


class SequenceMirror:
    """The workers' copy of the driver's running sequences, kept in step by `StepMessage`s."""

    def __init__(self) -> None:
        self.seqs: dict[int, Sequence] = {}

    def apply(self, msg: StepMessage) -> SchedulerOutput:
        for fid in msg.finished:
            self.seqs.pop(fid, None)
        for n in msg.new:
            seq = Sequence(n.request_id, n.prompt_token_ids, n.sampling_params, n.index)
            seq.seq_id = n.seq_id
            seq.bad_words_token_ids = n.bad_words_token_ids
            self.seqs[n.seq_id] = seq
        out = SchedulerOutput()
        tokens, blocks = msg.tokens.tolist(), msg.blocks.tolist()
        t = b = 0
        for seq_id, start, num_new, pending, num_tokens, table_start, num_blocks, rope_len in msg.steps.tolist():
            seq = self.seqs[seq_id]
            if num_tokens:
                seq.token_ids += tokens[t : t + num_tokens]
                t += num_tokens
            if table_start == 0:
                seq.block_table = blocks[b : b + num_blocks]
            else:
                del seq.block_table[table_start:]
                seq.block_table += blocks[b : b + num_blocks]
            b += num_blocks
            seq.num_computed_tokens = start
            seq.num_pending_tokens = pending
            seq.rope_prefill_len = rope_len
            out.scheduled.append(ScheduledSeq(seq, num_new))
        return out


class StepEncoder:
    """Driver side of `SequenceMirror`: remembers what each sequence has sent, so a message carries only
    the tokens and block ids that changed. A block table is tracked by identity: `BlockManager.free`
    gives a preempted sequence a new list, which is then sent whole."""

    def __init__(self) -> None:
        self.seqs: dict[int, Sequence] = {}
        self._sent: dict[int, tuple[int, list[int] | None, int]] = {}
        """seq_id -> (host tokens sent, the block table list last sent, its length then)."""

    def encode(self, sched: SchedulerOutput) -> StepMessage:
        finished = [sid for sid, seq in self.seqs.items() if seq.is_finished]
        for sid in finished:
            del self.seqs[sid], self._sent[sid]
        new, rows, tokens, blocks = [], [], [], []
        for s in sched.scheduled:
            seq = s.seq
            sid = seq.seq_id
            if sid not in self.seqs:
                new.append(NewSeq(sid, seq.request_id, seq.index, seq.prompt_token_ids, seq.sampling_params,
                                  seq.bad_words_token_ids))
                self.seqs[sid] = seq
                self._sent[sid] = (seq.num_prompt_tokens, None, 0)
            num_sent, table_sent, num_blocks_sent = self._sent[sid]
            table, num_tokens = seq.block_table, len(seq.token_ids)
            table_start = num_blocks_sent if table is table_sent else 0
            tokens += seq.token_ids[num_sent:]
            blocks += table[table_start:]
            rows.append((sid, s.start, s.num_new_tokens, seq.num_pending_tokens, num_tokens - num_sent,
                         table_start, len(table) - table_start, seq.rope_prefill_len))
            self._sent[sid] = (num_tokens, table, len(table))
        return StepMessage(new, finished, np.array(rows, dtype=np.int64).reshape(-1, len(STEP_FIELDS)),
                           np.array(tokens, dtype=np.int64), np.array(blocks, dtype=np.int64))


def attach_bitmask(msg: StepMessage, sched: SchedulerOutput, bitmask_hook) -> None:
    """Driver side, after encoding: the grammar mask of the step's sampling rows from the engine's `bitmask_hook`
    (it first completes the step in flight, whose tokens the grammars need), carried by the message to every worker,
    since the workers sample."""
    if bitmask_hook is None:
        return
    mask = bitmask_hook([s.seq for s in sched.scheduled if s.samples])  # `prepare_inputs`' sample_seqs order
    mask = mask() if callable(mask) else mask
    if mask is not None:
        msg.bitmask = mask.cpu().numpy()
