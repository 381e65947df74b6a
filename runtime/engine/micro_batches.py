"""Pipeline parallelism on the driver: up to `depth` micro-batches in flight, so every stage has work.

With ``pipeline_parallel_size`` P the model is split into P stages (runtime/worker/pipeline.py). If the
engine waited for each step's tokens before scheduling the next, stage k would idle while the others
run: P - 1 of P stages idle at any time. Instead (the shape of vLLM's ``batch_queue`` in its engine
core) the driver keeps up to P scheduled batches in flight, made of disjoint sets of sequences: batch
i + 1 is sent while batch i is still in the pipeline, so stage 0 computes batch i + 1 while stage 1
computes batch i, and so on. The last stage samples; its tokens come back in launch order, and a
sequence is scheduled again only once the batch holding it has returned (its next input token is only
known then). Each batch takes at most ceil(active sequences / P) sequences, so the active sequences
are spread over the P batches rather than all landing in the first.

The scheduler enforces the disjointness (`Scheduler.in_flight`: not scheduled, not preempted while in
flight); this module owns the queue of launched batches.
"""

from __future__ import annotations

import collections


class MicroBatchQueue:
    """The launched batches of a pipelined engine, oldest first.

    Attributes: depth (the most batches in flight: the pipeline size), max_in_flight (the most there
    ever were at once: > 1 shows the stages overlapped), num_launched.
    """

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"MicroBatchQueue depth={depth} must be >= 1")
        self.depth = depth
        self.in_flight: collections.deque = collections.deque()
        self.max_in_flight = 0
        self.num_launched = 0

    def batch_seq_limit(self, scheduler) -> int:
        """Sequences one batch may take: the active ones (capped at max_num_seqs) shared over `depth`."""
        active = min(scheduler.max_num_seqs, len(scheduler.running) + len(scheduler.waiting))
        return max(1, -(-active // self.depth))

    def step(self, engine) -> list:
        """Fill the pipeline with new batches, complete the oldest, refill; the oldest's RequestOutputs.

        `engine` is the `LLMEngine` (its scheduler, `_launch` without waiting, `_complete`). Returns []
        when nothing is in flight and nothing can be scheduled; RuntimeError when requests wait that no
        schedule can ever admit (a bug: add_request checks each fits the cache alone).
        """
        scheduler = engine.scheduler
        self._fill(engine)
        if not self.in_flight:
            if scheduler.waiting and not scheduler.running:
                raise RuntimeError(f"no request can be scheduled: {engine.get_stats()}")
            return []
        oldest = self.in_flight.popleft()
        for s in oldest.sched.scheduled:
            scheduler.in_flight.discard(s.seq.seq_id)
        try:
            outputs = engine._complete(oldest)
        except BaseException:
            self._fail(engine)
            raise
        # Relaunch at once: the stages idle from the moment a batch's tokens land until its sequences are
        # in flight again, so the caller's handling of the outputs must not sit inside that gap.
        self._fill(engine)
        return outputs

    def _fill(self, engine) -> None:
        """Schedule and launch batches until `depth` are in flight or nothing more can be scheduled."""
        scheduler = engine.scheduler
        while len(self.in_flight) < self.depth:
            scheduler.batch_seq_limit = self.batch_seq_limit(scheduler)
            sched = scheduler.schedule()
            if sched.is_empty():
                break
            try:
                launched = engine._launch(sched, None, wait=False)
            except BaseException:
                self._fail(engine)
                raise
            scheduler.in_flight.update(s.seq.seq_id for s in sched.scheduled)
            self.in_flight.append(launched)
            self.num_launched += 1
            self.max_in_flight = max(self.max_in_flight, len(self.in_flight))

    def _fail(self, engine) -> None:
        """A launch or a result failed (the workers are gone): forget the batches in flight and end every
        request, freeing its KV blocks, as `LLMEngine.step` does without a pipeline (the batches still in
        flight had advanced their sequences: their tokens will never come)."""
        self.in_flight.clear()
        engine.scheduler.in_flight.clear()
        engine._abort_all()
