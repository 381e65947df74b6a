"""Block manager: ref counts, prefix-cache hits only on computed full blocks, no leaks."""

import pytest

from fxrewrite.runtime.engine.block_manager import BlockManager
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.sequence import Sequence


def make_seq(tokens):
    return Sequence("r", list(tokens), SamplingParams())


def run_prefill(bm, seq):
    cached = bm.find_cached_prefix(seq)
    n = seq.num_tokens - len(cached) * bm.block_size
    assert bm.can_allocate(seq, cached, n)
    bm.allocate(seq, cached, n)
    seq.num_computed_tokens += n
    bm.commit(seq)
    return len(cached)


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(8, 4)
    seq = make_seq(range(10))
    run_prefill(bm, seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_cache_salt_shares_blocks_only_between_requests_of_the_same_salt():
    """vLLM's cache_salt: a prefix cached under one salt (or none) is not found under another; the same salt finds it."""
    bm = BlockManager(16, 4)
    salts = ["tenant-a", "tenant-b", None, "tenant-a"]
    seqs = [make_seq(range(10)) for _ in salts]
    for seq, salt in zip(seqs, salts):
        seq.cache_salt = salt
    assert [run_prefill(bm, seq) for seq in seqs] == [0, 0, 0, 2]
    assert seqs[3].block_table[:2] == seqs[0].block_table[:2]


def test_prefix_hit_reuses_computed_full_blocks_and_shares_them():
    bm = BlockManager(8, 4)
    a, b = make_seq(range(10)), make_seq(list(range(8)) + [99, 98, 97])
    run_prefill(bm, a)
    assert run_prefill(bm, b) == 2
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.prefix_cache_hits == 8 and bm.prefix_cache_queries == 21
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_hit_survives_free_and_never_covers_the_last_token():
    bm = BlockManager(8, 4)
    a = make_seq(range(8))
    run_prefill(bm, a)
    bm.free(a)
    again = make_seq(range(8))
    assert len(bm.find_cached_prefix(again)) == 1  # one token must still run to get logits
    assert run_prefill(bm, again) == 1
    bm.free(again)
    assert bm.num_free_blocks == 8


def test_uncomputed_blocks_are_not_hits_and_reuse_drops_hash():
    bm = BlockManager(2, 4)
    a = make_seq(range(8))
    bm.allocate(a, [], 8)  # allocated, not computed, not committed
    assert bm.find_cached_prefix(make_seq(range(9))) == []
    a.num_computed_tokens = 8
    bm.commit(a)
    bm.free(a)
    other = make_seq([7] * 8)
    run_prefill(bm, other)  # takes both blocks: their old hashes must be gone
    assert bm.find_cached_prefix(make_seq(range(9))) == []
    bm.free(other)


def test_cannot_allocate_beyond_free_blocks():
    bm = BlockManager(2, 4)
    seq = make_seq(range(9))
    assert not bm.can_allocate(seq, [], 9)
    with pytest.raises(RuntimeError):
        bm.append_slots(seq, 9)


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = make_seq(range(9))
    run_prefill(bm, a)
    assert bm.find_cached_prefix(make_seq(range(9))) == []
    assert bm.prefix_cache_queries == 0
