"""Pipeline micro-batches on the driver: the scheduler keeps in-flight sequences out of new batches
(and never preempts them), batches share the active sequences, the queue keeps `depth` batches in
flight and completes them oldest first (end to end with real stages: tests/distributed/test_pipeline_parallel.py)."""

from __future__ import annotations

import pytest

from fxrewrite.runtime.engine.block_manager import BlockManager
from fxrewrite.runtime.engine.micro_batches import MicroBatchQueue
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.scheduler import Scheduler
from fxrewrite.runtime.engine.sequence import Sequence


def _seqs(sched: Scheduler, n: int, prompt_len: int = 3) -> list[Sequence]:
    seqs = [Sequence(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams()) for i in range(n)]
    for s in seqs:
        sched.add(s)
    return seqs


def test_in_flight_sequences_are_not_scheduled_and_batches_share_the_work():
    sched = Scheduler(BlockManager(64, 4, False), max_num_seqs=8, max_num_batched_tokens=64)
    seqs = _seqs(sched, 5)
    queue = MicroBatchQueue(2)
    sched.batch_seq_limit = queue.batch_seq_limit(sched)
    first = sched.schedule()
    assert sched.batch_seq_limit == 3 and [s.seq for s in first.scheduled] == seqs[:3]
    sched.advance(first)
    sched.in_flight.update(s.seq.seq_id for s in first.scheduled)
    second = sched.schedule()
    assert [s.seq for s in second.scheduled] == seqs[3:]  # the other two; none of the first batch's
    sched.in_flight.update(s.seq.seq_id for s in second.scheduled)
    assert sched.schedule().is_empty()  # everything is in flight


def test_blocks_held_by_in_flight_batches_wait_instead_of_preempting_them():
    bm = BlockManager(2, 4, False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = _seqs(sched, 2, prompt_len=4)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a, b] and bm.num_free_blocks == 0
    sched.advance(out)
    for s in (a, b):
        s.append_token(7)  # both need a second block now
    sched.in_flight.add(b.seq_id)
    out = sched.schedule()
    assert out.is_empty() and out.num_preempted == 0  # a waits: b (in flight) is not a victim
    assert list(sched.running) == [a, b] and b.block_table and a.block_table
    sched.in_flight.clear()
    out = sched.schedule()  # with nothing in flight, the newest (b) is preempted as before
    assert out.num_preempted == 1 and [s.seq for s in out.scheduled] == [a] and list(sched.waiting) == [b]


class _Step:
    def __init__(self, sched):
        self.sched = sched


class _FakeEngine:
    """What MicroBatchQueue.step uses of LLMEngine: a scheduler, _launch, _complete, get_stats."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.launched, self.completed = [], []

    def _launch(self, sched, previous, wait=None):
        assert previous is None and wait is False
        self.scheduler.advance(sched)
        self.launched.append([s.seq.request_id for s in sched.scheduled])
        return _Step(sched)

    def _complete(self, step):
        for s in step.sched.scheduled:
            s.seq.append_token(9)
            if s.seq.num_output_tokens >= 2:
                self.scheduler.finish(s.seq)
        self.completed.append([s.seq.request_id for s in step.sched.scheduled])
        return self.completed[-1]

    def get_stats(self):
        return {}

    def _abort_all(self):
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self.scheduler.finish(seq)


def test_queue_keeps_depth_batches_in_flight_and_completes_oldest_first():
    sched = Scheduler(BlockManager(64, 4, False), max_num_seqs=8, max_num_batched_tokens=64)
    _seqs(sched, 4)
    engine, queue = _FakeEngine(sched), MicroBatchQueue(2)
    # launched [r0, r1] and [r2, r3], completed the first, relaunched its sequences before returning
    assert queue.step(engine) == ["r0", "r1"]
    assert engine.launched == [["r0", "r1"], ["r2", "r3"], ["r0", "r1"]] and len(queue.in_flight) == 2
    assert queue.step(engine) == ["r2", "r3"]  # r2, r3 completed, then relaunched
    assert engine.launched[3] == ["r2", "r3"]
    while queue.step(engine):
        pass
    assert queue.max_in_flight == 2 and not sched.running and not queue.in_flight and not sched.in_flight
    assert sorted(map(tuple, engine.completed)) == sorted(map(tuple, engine.launched))


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="depth=0"):
        MicroBatchQueue(0)


def test_a_failed_launch_ends_every_request_and_frees_its_blocks():
    """A launch that raised left the other batch's sequences advanced (tokens that never come) and every
    request holding its KV blocks; without a pipeline the engine aborts them all."""
    bm = BlockManager(64, 4, False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    _seqs(sched, 4)
    engine, queue = _FakeEngine(sched), MicroBatchQueue(2)
    launch = engine._launch

    def second_fails(sched_out, previous, wait=None):
        if engine.launched:
            raise RuntimeError("worker gone")
        return launch(sched_out, previous, wait)

    engine._launch = second_fails
    with pytest.raises(RuntimeError, match="worker gone"):
        queue.step(engine)
    assert not queue.in_flight and not sched.in_flight
    assert not sched.running and not sched.waiting and bm.num_free_blocks == 64
