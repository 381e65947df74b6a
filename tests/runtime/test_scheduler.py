"""Scheduler: chunked prefill under the token budget, mixed decode+prefill, preemption, waiting."""

from fxrewrite.runtime.engine.block_manager import BlockManager
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.scheduler import Scheduler
from fxrewrite.runtime.engine.sequence import Sequence, SequenceStatus


def make_seq(n, start=0):
    return Sequence("r", list(range(start, start + n)), SamplingParams())


def step(sched, next_token=1):
    out = sched.schedule()
    sampled = [s.seq for s in out.scheduled if s.samples]
    sched.advance(out)
    for seq in sampled:
        seq.append_token(next_token)
    sched.commit(out)
    return out


def test_chunked_prefill_respects_budget_and_mixes_decode():
    sched = Scheduler(BlockManager(32, 4, False), max_num_seqs=8, max_num_batched_tokens=6)
    a, b = make_seq(3), make_seq(10, 100)
    sched.add(a)
    sched.add(b)
    out = step(sched)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 3), (b, 3)]
    assert out.scheduled[0].samples and not out.scheduled[1].samples
    out = step(sched)  # a decodes 1 token, b continues its prefill with the rest of the budget
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 5)]
    out = step(sched)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 2)]
    assert out.scheduled[1].samples


def test_preemption_frees_blocks_and_recomputes():
    bm = BlockManager(4, 4, False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make_seq(8), make_seq(7, 50)
    sched.add(a)
    sched.add(b)
    step(sched)  # a: 2 blocks, b: 2 blocks, cache full
    assert bm.num_free_blocks == 0
    out = step(sched)  # a needs a third block -> b (the latest) is preempted
    assert out.num_preempted == 1 and sched.num_preemptions == 1
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert [s.seq for s in out.scheduled] == [a]


def test_waiting_request_waits_for_blocks_and_max_num_seqs():
    bm = BlockManager(3, 4, False)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64)
    a, b = make_seq(4), make_seq(4, 10)
    sched.add(a)
    sched.add(b)
    out = step(sched)
    assert [s.seq for s in out.scheduled] == [a] and list(sched.waiting) == [b]
    sched.finish(a)
    assert bm.num_free_blocks == 3
    out = step(sched)
    assert [s.seq for s in out.scheduled] == [b]


def test_longrope_switch_recomputes_the_sequence_with_long_factors():
    """Past original_max_position_embeddings (8 here) a short-factor sequence is prefilled again whole,
    as transformers' Phi-3 drops its cache there; its blocks then hash apart from short-factor ones."""
    from fxrewrite.runtime.engine.rope_lengths import LengthDependentRope

    bm = BlockManager(16, 4, True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, rope=LengthDependentRope("longrope", 8))
    a, long_ = make_seq(6), make_seq(10)  # the same first 6 tokens; long_ is past 8 from the start
    sched.add(a)
    assert [s.num_new_tokens for s in step(sched).scheduled] == [6]
    step(sched), step(sched)  # positions 6, 7: 8 tokens computed, a 9th sampled
    assert a.num_computed_tokens == 8 and a.num_tokens == 9 and a.rope_prefill_len == 6
    out = step(sched)
    assert [(s.seq, s.start, s.num_new_tokens) for s in out.scheduled] == [(a, 0, 9)]  # recomputed whole
    assert a.rope_prefill_len == 9 and sched.num_preemptions == 0
    assert [(s.start, s.num_new_tokens) for s in step(sched).scheduled] == [(9, 1)]  # then decodes on
    sched.add(long_)
    out = step(sched)  # a's recomputed (long-factor) first block is shared
    assert [(s.seq, s.start) for s in out.scheduled][-1] == (long_, 4)
    assert long_.block_hash_salt == a.block_hash_salt == -1


def test_prefix_cache_keeps_longrope_regimes_apart():
    from fxrewrite.runtime.engine.rope_lengths import LengthDependentRope

    sched = Scheduler(BlockManager(16, 4, True), 8, 64, rope=LengthDependentRope("longrope", 8))
    short, long_, short2 = make_seq(6), make_seq(10), make_seq(7)
    sched.add(short)
    step(sched)  # short-factor blocks of tokens 0..3 committed
    sched.add(long_)
    assert [(s.seq, s.start) for s in step(sched).scheduled][-1] == (long_, 0)  # not reused
    sched.add(short2)
    assert [(s.seq, s.start) for s in step(sched).scheduled][-1] == (short2, 4)  # same regime: reused
