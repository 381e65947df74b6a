"""CPU (gloo) workers are capped per usable CPU before any starts: DP=64 x TP=2 on 2 CPUs ran out of memory."""

from types import SimpleNamespace

import pytest

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.worker import dp_checks


def _config(dp: int, tp: int = 1, pp: int = 1):
    return SimpleNamespace(data_parallel_size=dp, tensor_parallel_size=tp, pipeline_parallel_size=pp, device="cpu")


def test_cpu_workers_beyond_four_per_cpu_are_refused(monkeypatch):
    monkeypatch.setattr(dp_checks, "usable_cpus", lambda: 2)
    dp_checks.check_gpu_count(_config(dp=4, tp=2))  # 8 workers on 2 CPUs: the opt-in 8-rank test's setting
    with pytest.raises(UserInputError, match=r"data_parallel_size=64 x tensor_parallel_size=2 x "
                                             r"pipeline_parallel_size=1 starts 128 CPU worker processes on 2 usable "
                                             r"CPUs; at most 8 \(4 per CPU\)"):
        dp_checks.check_gpu_count(_config(dp=64, tp=2))


def test_llm_refuses_too_many_cpu_replicas_before_workers_start(tiny_qwen3_dir, monkeypatch):
    import torch.multiprocessing as mp

    from fxrewrite import LLM

    monkeypatch.setattr(mp, "start_processes", lambda *a, **k: pytest.fail("a worker started"))
    cap = dp_checks.MAX_CPU_WORKERS_PER_CPU * dp_checks.usable_cpus()
    with pytest.raises(UserInputError, match=f"starts {cap + 1} CPU worker processes"):
        LLM(str(tiny_qwen3_dir), data_parallel_size=cap + 1, device="cpu")
