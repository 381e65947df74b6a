"""Prefix caching of a request that finishes in the step that prefilled it (max_tokens=1, a first-token stop):
its full blocks are cached before they are freed."""

import pytest

from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM

from tests.runtime.test_engine import assert_no_leak


@pytest.fixture(scope="module")
def qwen3_llm(tiny_qwen3_dir):
    return LLM(str(tiny_qwen3_dir), model_impl="native", dtype="float32", block_size=4)


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_a_request_ending_in_its_prefill_step_fills_the_prefix_cache(qwen3_llm, max_tokens):
    """Its full blocks are cached when it finishes (they were freed before the step's commit: a max_tokens=1 or
    first-token-EOS request never cached its prompt; a fresh user's find); the repeat takes them, same token."""
    prompt = {"prompt_token_ids": [7 + max_tokens + i % 50 for i in range(61)]}  # 15 full blocks of 4
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    first, again = (qwen3_llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert first.metrics["num_cached_tokens"] == 0 and again.metrics["num_cached_tokens"] == 60
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_no_leak(qwen3_llm)
