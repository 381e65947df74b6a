"""The profiling step's dummy prefill metadata (CPU); the sizing itself runs in test_gpu_cuda_graphs."""

from __future__ import annotations

import torch

from fxrewrite.runtime.worker.memory_profiling import _dummy_metadata


def test_dummy_prefill_splits_tokens_into_sequences_with_own_blocks():
    positions, meta, num_blocks = _dummy_metadata(40, 16, 8, torch.device("cpu"))
    assert meta.seq_lens.tolist() == [16, 16, 8]
    assert meta.query_start_loc.tolist() == [0, 16, 32, 40]
    assert num_blocks == 3 * 2 and meta.block_tables.tolist() == [[0, 1], [2, 3], [4, 5]]
    assert positions.tolist() == list(range(16)) * 2 + list(range(8))
    # token i of sequence b is written into its own blocks: slot = table[b][pos // 8] * 8 + pos % 8
    expected = [meta.block_tables[b, p // 8].item() * 8 + p % 8
                for b, n in enumerate([16, 16, 8]) for p in range(n)]
    assert meta.slot_mapping.tolist() == expected
    assert meta.max_query_len == meta.max_seq_len == 16
