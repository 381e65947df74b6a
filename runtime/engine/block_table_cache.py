"""The previous step's block tables, kept as one padded array, so a decode step writes only the new blocks."""

from __future__ import annotations

import itertools
import operator

import numpy as np


class BlockTableCache:
    """Padded int32 block tables [B, capacity] of the last step, one row per sequence, rows found again by the
    identity of the sequence's `block_table` list.

    A sequence's table only grows (the block manager appends; freeing gives the sequence a new list), so a row
    whose list is the same object as last step's is right up to last step's length: a steady decode batch of long
    sequences costs O(blocks appended) a step, not O(blocks held) (256 sequences of ~4k tokens: `prepare_inputs`
    1.38 -> 0.29 ms a step on this project's 2-core CPU, `benchmarks/host_step.py`). The cache holds the lists
    it last saw, so their ids cannot be reused by new lists while it compares them. One cache per model runner.
    """

    def __init__(self) -> None:
        self._tables: list[list[int]] = []
        self._lens = np.zeros(0, dtype=np.int64)
        self._array = np.zeros((0, 0), dtype=np.int32)

    def update(self, tables: list[list[int]], table_lens: np.ndarray) -> np.ndarray:
        """The tables as a [len(tables), >= max(table_lens)] int32 array padded with 0 (a view: read it before the
        next call). `table_lens` [B] int64 are the tables' lengths."""
        num_seqs = len(tables)
        needed = int(table_lens.max()) if num_seqs else 0
        old = self._array
        if len(self._tables) == num_seqs and all(map(operator.is_, tables, self._tables)):
            array, lens = old, self._lens
            if needed > old.shape[1]:  # widen, keeping the rows
                array = np.zeros((num_seqs, max(needed, 2 * old.shape[1])), dtype=np.int32)
                array[:, : old.shape[1]] = old
        else:  # the batch changed: carry over the rows of sequences seen last step, by list identity
            where = {id(t): i for i, t in enumerate(self._tables)}
            rows = np.fromiter((where.get(id(t), -1) for t in tables), dtype=np.int64, count=num_seqs)
            kept = np.flatnonzero(rows >= 0)
            array = np.zeros((num_seqs, max(needed, old.shape[1])), dtype=np.int32)
            array[kept, : old.shape[1]] = old[rows[kept]]
            lens = np.zeros(num_seqs, dtype=np.int64)
            lens[kept] = self._lens[rows[kept]]
        for i in np.flatnonzero(table_lens != lens).tolist():
            start, end = int(lens[i]), int(table_lens[i])
            if end < start:  # not expected (tables only grow); rewritten whole all the same
                array[i], start = 0, 0
            array[i, start:end] = tables[i][start:end]
        self._tables, self._lens, self._array = list(tables), table_lens.copy(), array
        return array


def fill_block_tables(out: np.ndarray, tables: list[list[int]], table_lens: np.ndarray) -> None:
    """Write `tables` into `out` [len(tables), max_blocks] int32 (already zero), from scratch."""
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(table_lens.sum()))
    out[np.arange(out.shape[1])[None, :] < table_lens[:, None]] = flat
