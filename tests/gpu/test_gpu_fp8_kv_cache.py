"""FP8 KV cache on the GPU through the engine (the kernels' own GPU checks are in
tests/kernels/test_fp8_kv_cache.py): CUDA-graph decode equals eager over the e4m3 cache, for the native model
(its fused q/k-norm + RoPE + cache kernel clamps and casts to e4m3 as the unfused pair would) and the
rewritten transformers model; memory profiling sizes twice the bf16 cache's blocks; a first token the plain
(float32) cache also picks has a log-probability within 0.1 of its."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _prompts():
    return [[int(t) for t in torch.randint(0, 10000, (n,), generator=torch.Generator().manual_seed(n))]
            for n in (5, 17, 40, 300)]


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_fp8_kv_cache_graphs_match_eager(make_llm, impl):
    from fxrewrite.runtime.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    fast = make_llm(model_impl=impl, kv_cache_dtype="fp8")
    assert fast.llm_engine.model_runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    got = fast.generate(_prompts(), params, use_tqdm=False)
    slow = make_llm(model_impl=impl, kv_cache_dtype="fp8", enforce_eager=True)
    slow = slow.generate(_prompts(), params, use_tqdm=False)
    plain = make_llm(model_impl=impl).generate(_prompts(), params, use_tqdm=False)
    for a, b, c in zip(got, slow, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        first = a.outputs[0].logprobs[0]
        token = next(iter(first))
        if token == c.outputs[0].token_ids[0]:  # same first token: its logprob near the plain cache's
            assert abs(first[token].logprob - c.outputs[0].logprobs[0][token].logprob) < 0.1


def test_fp8_dots_over_keys_contiguous_values_graphs_match_eager(make_llm, monkeypatch):
    """FXREWRITE_KV_FP8_DOTS=float8: the value cache keys-contiguous, decode on FP8 tensor cores; CUDA-graph decode
    gives eager's tokens."""
    from fxrewrite.runtime.engine.sampling_params import SamplingParams

    monkeypatch.setenv("FXREWRITE_KV_FP8_DOTS", "float8")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    fast = make_llm(kv_cache_dtype="fp8")
    assert fast.llm_engine.model_runner.kv_caches[0][1].stride(1) == 1
    got = fast.generate(_prompts(), params, use_tqdm=False)
    slow = make_llm(kv_cache_dtype="fp8", enforce_eager=True).generate(_prompts(), params, use_tqdm=False)
    assert [a.outputs[0].token_ids for a in got] == [b.outputs[0].token_ids for b in slow]


def test_fp8_kv_cache_profiled_blocks_double(small_model_dir):
    import gc

    from fxrewrite.runtime.llm import LLM

    blocks = {}
    for kv in ("auto", "fp8"):
        llm = LLM(str(small_model_dir), load_format="dummy", model_impl="native", gpu_memory_utilization=0.3,
                  max_model_len=1024, dtype="bfloat16", kv_cache_dtype=kv)
        blocks[kv] = llm.llm_engine.model_runner.num_blocks
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert 1.9 < blocks["fp8"] / blocks["auto"] < 2.1, blocks
