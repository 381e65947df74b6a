"""The driver's `StepEncoder` and the workers' `SequenceMirror` (no processes): after every message the
mirror's sequences equal the driver's, through chunked prefill, decode with a token in flight,
preemption (a new block table, sent whole) and finished sequences; messages carry only deltas."""

import pickle
import random

from fxrewrite.runtime.engine.block_manager import BlockManager
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.scheduler import ScheduledSeq, SchedulerOutput
from fxrewrite.runtime.engine.sequence import Sequence, SequenceStatus
from fxrewrite.runtime.worker.step_messages import SequenceMirror, StepEncoder


def _schedule(*chunks: tuple[Sequence, int]) -> SchedulerOutput:
    out = SchedulerOutput()
    out.scheduled = [ScheduledSeq(seq, n) for seq, n in chunks]
    return out


def _send(encoder: StepEncoder, mirror: SequenceMirror, sched: SchedulerOutput):
    msg = pickle.loads(pickle.dumps(encoder.encode(sched)))  # what goes over the wire
    got = mirror.apply(msg)
    assert len(got.scheduled) == len(sched.scheduled)
    for want, have in zip(sched.scheduled, got.scheduled, strict=True):
        assert have.seq is mirror.seqs[want.seq.seq_id] and have.seq is not want.seq  # the mirror's own copy
        seq, copy = want.seq, have.seq
        assert (copy.seq_id, copy.token_ids, copy.block_table) == (seq.seq_id, seq.token_ids, seq.block_table)
        assert (copy.num_computed_tokens, copy.num_pending_tokens) == (seq.num_computed_tokens, seq.num_pending_tokens)
        assert (have.start, have.num_new_tokens, have.samples) == (want.start, want.num_new_tokens, want.samples)
    # the mirror holds exactly the driver's live sequences (finished ones dropped on both sides)
    assert sorted(mirror.seqs) == sorted(encoder.seqs)
    return msg


def _advance(bm: BlockManager, sched: SchedulerOutput) -> None:
    """What the engine does at launch: tokens count as computed; a sampled token is in flight."""
    for s in sched.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        if s.samples:
            s.seq.num_pending_tokens += 1


def test_mirror_follows_the_driver_with_deltas():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=64, block_size=4)
    params = SamplingParams(max_tokens=50)
    a = Sequence("a", [rng.randrange(1000) for _ in range(10)], params)
    b = Sequence("b", [rng.randrange(1000) for _ in range(3)], params)
    encoder, mirror = StepEncoder(), SequenceMirror()

    bm.allocate(a, [], 6)
    msg = _send(encoder, mirror, s := _schedule((a, 6)))  # first prefill chunk of a
    assert [n.seq_id for n in msg.new] == [a.seq_id] and msg.tokens.size == 0
    _advance(bm, s)
    bm.append_slots(a, 4)
    bm.allocate(b, [], 3)
    s = _schedule((a, 4), (b, 3))  # a's last chunk (samples), b's whole prompt (samples)
    msg = _send(encoder, mirror, s)
    assert msg.blocks.tolist() == a.block_table[2:] + b.block_table  # a's first two ids are not sent again
    _advance(bm, s)
    for step in range(6):  # decode: the previous token is in flight when the next step is sent
        for seq in (a, b):
            if step:  # the token of two steps ago reached the host
                seq.append_token(rng.randrange(1000))
            bm.append_slots(seq, 1)
        s = _schedule((a, 1), (b, 1))
        msg = _send(encoder, mirror, s)
        assert msg.tokens.size == (2 if step else 0) and msg.blocks.size <= 2
        _advance(bm, s)

    bm.free(b)  # preempted: blocks freed, recomputed later under a new table
    b.num_pending_tokens = 0
    b.append_token(rng.randrange(1000))
    a.append_token(rng.randrange(1000))
    bm.append_slots(a, 1)
    bm.allocate(b, [], b.num_tokens)
    msg = _send(encoder, mirror, _schedule((a, 1), (b, b.num_tokens)))
    row = msg.steps.tolist()[1]
    assert row[5] == 0 and row[6] == len(b.block_table)  # b's new table, whole

    a.status = SequenceStatus.FINISHED
    msg = _send(encoder, mirror, _schedule((b, 1)))
    assert msg.finished == [a.seq_id] and a.seq_id not in mirror.seqs
    assert list(mirror.seqs) == list(encoder.seqs) == [b.seq_id]
