"""Continuous batching with chunked prefill and preemption by recompute."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fxrewrite.runtime.engine.block_manager import BlockManager
from fxrewrite.runtime.engine.rope_lengths import LengthDependentRope
from fxrewrite.runtime.engine.sequence import Sequence, SequenceStatus


@dataclass(init=False)
class ScheduledSeq:
    """A sequence and how many of its tokens run this step (1 when decoding, a chunk when prefilling)."""

    seq: Sequence
    num_new_tokens: int
    samples: bool = field(init=False)
    """True when this step's chunk reaches the sequence's last token, so a new token is sampled."""
    start: int = field(init=False)
    """num_computed_tokens when scheduled: position of the first token that runs."""

    def __init__(self, seq: Sequence, num_new_tokens: int) -> None:  # one made per sequence per step: no __post_init__
        self.seq, self.num_new_tokens = seq, num_new_tokens
        self.start = start = seq.num_computed_tokens
        self.samples = start + num_new_tokens == len(seq.token_ids) + seq.num_pending_tokens  # seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_preempted: int = 0
    reads_host_tokens: bool | None = None
    """Set at launch (LLMEngine._launch): whether a scheduled sequence samples with penalties or bad words."""

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides, each step, which tokens of which sequences run.

    Running sequences go first (decodes and unfinished prefills), in arrival order; when one cannot get a
    block, the most recently admitted running sequence is preempted: its blocks are freed and it goes back
    to the front of the waiting queue, to be recomputed later (prompt + output so far). Waiting sequences
    are admitted while the token budget (max_num_batched_tokens), max_num_seqs and free blocks allow; a
    long prompt is split into chunks across steps. A waiting sequence that cannot get blocks waits.
    With a LongRoPE model (`rope`), a sequence that first grows past original_max_position_embeddings
    is recomputed the same way, with the long factors, as transformers' Phi-3 does (rope_lengths.py).
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 rope: LengthDependentRope | None = None):
        self.block_manager = block_manager
        self.rope = rope
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.in_flight: set[int] = set()
        """seq ids in a batch still in the pipeline (pipeline parallelism, runtime/engine/micro_batches.py):
        not scheduled again, nor preempted, until that batch's tokens are back."""
        self.batch_seq_limit: int | None = None
        """At most this many sequences per batch (None: max_num_seqs), so in-flight batches share the work."""

    def add(self, seq: Sequence) -> None:
        if self.rope is not None:
            seq.block_hash_salt = self.rope.hash_salt(seq.rope_prefill_len)
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if out.num_preempted == 0:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        bm, kept = self.block_manager, []
        bs, running, in_flight, rope, scheduled = bm.block_size, self.running, self.in_flight, self.rope, out.scheduled
        limit = self.batch_seq_limit or self.max_num_seqs
        while running and budget > 0 and len(scheduled) < limit:
            seq = running.popleft()
            if seq.awaiting_final_token or seq.seq_id in in_flight:  # nothing to run until its tokens are back
                kept.append(seq)
                continue
            if rope is not None and rope.switches(seq):
                self._recompute_long(seq)
                continue
            computed = seq.num_computed_tokens
            n = min(len(seq.token_ids) + seq.num_pending_tokens - computed, budget)  # seq.num_tokens - computed
            # most decode steps: the blocks it holds take the tokens, nothing to allocate (can_append's answer)
            if computed + n <= len(seq.block_table) * bs:
                scheduled.append(ScheduledSeq(seq, n))
                kept.append(seq)
                budget -= n
                continue
            while not bm.can_append(seq, n):
                victim = self._victim(seq)
                if victim is None:  # only batches in flight hold blocks: wait for them
                    break
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                bm.append_slots(seq, n)
                out.scheduled.append(ScheduledSeq(seq, n))
                kept.append(seq)
                budget -= n
                continue
            if victim is None:
                kept.append(seq)
                break
        self.running.extendleft(reversed(kept))
        return budget

    def _victim(self, seq: Sequence) -> Sequence | None:
        """The most recently admitted running sequence not in flight (taken out of `running`), else `seq`
        itself; None when `seq` would be preempted only because in-flight batches hold the blocks."""
        for i in range(len(self.running) - 1, -1, -1):
            if self.running[i].seq_id not in self.in_flight:
                victim = self.running[i]
                del self.running[i]
                return victim
        return None if self.in_flight else seq

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        limit = self.batch_seq_limit or self.max_num_seqs
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and len(out.scheduled) < limit):
            seq = self.waiting[0]
            cached = bm.find_cached_prefix(seq)
            n = min(seq.num_tokens - len(cached) * bm.block_size, budget)
            if not bm.can_allocate(seq, cached, n):
                break
            bm.allocate(seq, cached, n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n

    def _recompute_long(self, seq: Sequence) -> None:
        """Drop seq's short-factor KV; it is prefilled again (front of the queue) with the long factors."""
        seq.rope_prefill_len = seq.num_tokens
        seq.block_hash_salt = self.rope.hash_salt(seq.rope_prefill_len)
        seq.token_block_hashes.clear()  # its blocks' hashes now start from the new salt
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def advance(self, out: SchedulerOutput) -> None:
        """Once the step is launched: its tokens count as computed (their K/V are written in stream order,
        before any later step reads them)."""
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens

    def commit(self, out: SchedulerOutput) -> None:
        """Once the step's sampled tokens are on the host: publish newly full blocks to the prefix cache
        (hashing needs the real token ids, so not before)."""
        self.block_manager.commit_running([s.seq for s in out.scheduled])

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
