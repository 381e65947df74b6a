"""BlockTableCache: every step's padded tables equal the ones built from scratch, whatever the batch did."""

import random

import numpy as np

from fxrewrite.runtime.engine.block_table_cache import BlockTableCache, fill_block_tables


def _scratch(tables):
    lens = np.array([len(t) for t in tables], dtype=np.int64)
    out = np.zeros((len(tables), int(lens.max())), dtype=np.int32)
    fill_block_tables(out, tables, lens)
    return out


def test_cached_tables_equal_tables_built_from_scratch():
    """400 random steps over a pool of sequences: tables grow by appends, sequences leave and join, the batch is
    reordered, a freed sequence gets a new (shorter) list, a steady batch repeats; each step's array, cut to the
    step's widest table, equals the from-scratch one (padding 0 included)."""
    rng = random.Random(0)
    next_block = iter(range(1, 10**6))
    pool = {i: [next(next_block) for _ in range(rng.randint(1, 5))] for i in range(12)}
    batch = list(pool)[:6]
    cache, kinds = BlockTableCache(), set()
    for _ in range(400):
        event = rng.choice(["steady", "steady", "steady", "join", "leave", "reorder", "free"])
        if event == "join" and len(batch) < len(pool):
            batch.append(rng.choice([i for i in pool if i not in batch]))
        elif event == "leave" and len(batch) > 1:
            batch.remove(rng.choice(batch))
        elif event == "reorder":
            rng.shuffle(batch)
        elif event == "free":
            victim = rng.choice(batch)
            pool[victim] = [next(next_block) for _ in range(rng.randint(1, 2))]  # preempted: a new list
        for i in batch:  # decode: some tables get a block
            if rng.random() < 0.3:
                pool[i].append(next(next_block))
        kinds.add(event)
        tables = [pool[i] for i in batch]
        lens = np.array([len(t) for t in tables], dtype=np.int64)
        got = cache.update(tables, lens)
        want = _scratch(tables)
        assert got.shape[0] == len(tables) and got.shape[1] >= want.shape[1]
        np.testing.assert_array_equal(got[:, : want.shape[1]], want)
        assert not got[:, want.shape[1]:].any()
    assert kinds == {"steady", "join", "leave", "reorder", "free"}


def test_steady_batch_writes_only_appended_blocks():
    """The same lists again: only the entries appended since are written (a mark left in a row that did not grow
    survives the step; a rebuild would overwrite it), in the same array."""
    tables = [[1, 2, 3], [4, 5], [6]]
    cache = BlockTableCache()
    first = cache.update(tables, np.array([3, 2, 1]))
    first[0, 0] = -1  # a mark where nothing grows
    tables[1].append(7)
    array = cache.update(tables, np.array([3, 3, 1]))
    assert array is first
    np.testing.assert_array_equal(array[:, :3], [[-1, 2, 3], [4, 5, 7], [6, 0, 0]])
    tables[2] = [8, 9]  # freed and refilled: a new list, rebuilt from it
    np.testing.assert_array_equal(cache.update(tables, np.array([3, 3, 2]))[:, :3], [[-1, 2, 3], [4, 5, 7], [8, 9, 0]])
