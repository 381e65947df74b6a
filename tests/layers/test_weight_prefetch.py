"""The L2 weight prefetch switch (`fxrewrite.layers.weight_prefetch`, FXREWRITE_L2_PREFETCH_MB) on a CPU: its value is
checked at engine start, and it does nothing where it cannot help (a CPU, prefill, torch.compile): the engine's
tokens do not change. The kernel and the CUDA-graph fork / join: tests/gpu/test_gpu_l2_prefetch.py."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.errors import UserInputError
from fxrewrite.layers import weight_prefetch
from fxrewrite.runtime.engine.sampling_params import SamplingParams


def test_budget_is_read_in_megabytes(monkeypatch):
    monkeypatch.delenv("FXREWRITE_L2_PREFETCH_MB", raising=False)
    assert weight_prefetch.prefetch_budget_bytes() == 0
    monkeypatch.setenv("FXREWRITE_L2_PREFETCH_MB", "24")
    assert weight_prefetch.prefetch_budget_bytes() == 24 << 20
    for bad in ("-1", "1.5", "on", "", "²", " 32"):
        monkeypatch.setenv("FXREWRITE_L2_PREFETCH_MB", bad)
        with pytest.raises(ValueError, match=rf"FXREWRITE_L2_PREFETCH_MB={bad!r}: expected a whole number"):
            weight_prefetch.prefetch_budget_bytes()


def test_nothing_is_forked_on_a_cpu(monkeypatch):
    monkeypatch.setenv("FXREWRITE_L2_PREFETCH_MB", "32")
    weight_prefetch.prefetch_weight(torch.zeros(8, 8), num_tokens=1)
    assert not weight_prefetch._pending
    weight_prefetch.join_prefetches(torch.device("cpu"))  # nothing to join


def test_engine_checks_the_switch_and_is_unchanged_by_it(tiny_qwen3_dir, monkeypatch):
    from fxrewrite.runtime.llm import LLM

    monkeypatch.setenv("FXREWRITE_L2_PREFETCH_MB", "lots")
    with pytest.raises(UserInputError, match="FXREWRITE_L2_PREFETCH_MB='lots'"):
        LLM(str(tiny_qwen3_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 22)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for mb in ("0", "32"):
        monkeypatch.setenv("FXREWRITE_L2_PREFETCH_MB", mb)
        llm = LLM(str(tiny_qwen3_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 22)
        tokens[mb] = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)]
    assert tokens["32"] == tokens["0"]
