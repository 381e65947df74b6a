"""Symmetric-memory all-reduce on 2 GPUs: the same sums as NCCL at every message size it takes,
inside CUDA graphs (the engine's TP=2 greedy test covers it inside a model: test_gpu_tensor_parallel)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h200-x2)"),
]


def test_symm_mem_sums_equal_nccl():
    from fxrewrite.benchmarks.all_reduce import run

    result = run(2)
    assert result["symm_mem_available"]
    taken = [r for r in result["rows"] if "symm_mem_us" in r]
    assert len(taken) >= 5, result
    for row in taken:
        assert row["max_abs_diff_vs_nccl"] <= 1e-2, row  # two addends: the same sum up to bf16 rounding
