"""Per-request checks before queueing: logprob limits and token ids outside the vocabulary are refused up front."""

from __future__ import annotations

import types

import pytest

from fxrewrite.runtime.engine.request_extras import check_request_extras
from fxrewrite.runtime.engine.sampling_params import SamplingParams, StructuredOutputsParams


def _config(tp=1, pp=1, dp=1, max_logprobs=20):
    return types.SimpleNamespace(max_logprobs=max_logprobs, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                 data_parallel_size=dp)


@pytest.mark.parametrize("sizes", [dict(tp=2), dict(pp=2), dict(dp=2)])
def test_nothing_refused_across_processes(sizes):
    """prompt_logprobs, bad_words and structured outputs are served with parallelism too
    (tests/distributed/constrained.py)."""
    check_request_extras(SamplingParams(prompt_logprobs=1, bad_words=["x"]), _config(**sizes), 100)
    check_request_extras(SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"})),
                         _config(**sizes), 100)


def test_logprobs_limit_names_the_value():
    with pytest.raises(ValueError, match="logprobs=21 is more than max_logprobs=20"):
        check_request_extras(SamplingParams(logprobs=21), _config(), 100)


def test_max_logprobs_minus_one_allows_up_to_the_vocabulary():
    """vLLM's max_logprobs=-1: no limit of the engine's own; the vocabulary still bounds a request."""
    check_request_extras(SamplingParams(logprobs=100, prompt_logprobs=100), _config(max_logprobs=-1), 100)
    with pytest.raises(ValueError, match=r"prompt_logprobs=101 is more than the vocabulary size \(100"):
        check_request_extras(SamplingParams(prompt_logprobs=101), _config(max_logprobs=-1), 100)


@pytest.mark.parametrize("value, ok", [(-1, True), (1, True), (0, False), (-2, False)])
def test_max_logprobs_values(value, ok):
    import argparse

    from fxrewrite.commands.engine_args import max_logprobs_value
    from fxrewrite.runtime.engine_config import EngineConfig

    if ok:
        assert EngineConfig(max_logprobs=value).max_logprobs == value == max_logprobs_value(str(value))
        return
    with pytest.raises(ValueError, match=rf"max_logprobs={value} must be a positive integer or -1 \(no limit\)"):
        EngineConfig(max_logprobs=value)
    with pytest.raises(argparse.ArgumentTypeError, match="positive integer or -1"):
        max_logprobs_value(str(value))


@pytest.mark.parametrize("params, ok", [
    (dict(allowed_token_ids=[7], min_tokens=2), False),  # the only allowed token is EOS while min_tokens holds
    (dict(allowed_token_ids=[7], min_tokens=2, ignore_eos=True), True),
    (dict(allowed_token_ids=[5, 7], min_tokens=2, stop_token_ids=[5]), False),
    (dict(allowed_token_ids=[5, 7], min_tokens=2, stop_token_ids=[5], ignore_eos=True), True),
    (dict(allowed_token_ids=[7]), True),
    (dict(allowed_token_ids=[9], bad_words=["x"]), False),  # "x" is token 9 alone
    (dict(allowed_token_ids=[9, 10], bad_words=["x"]), True),
])
def test_allowed_tokens_that_leave_nothing_to_sample_are_refused(params, ok):
    from fxrewrite.errors import UserInputError
    from fxrewrite.runtime.engine.request_extras import check_allowed_tokens

    sp = SamplingParams(**params)
    bad = [[9]] if sp.bad_words else []
    if ok:
        check_allowed_tokens(sp, bad, {7})
    else:
        with pytest.raises(UserInputError, match=r"allowed_token_ids=\[.*\] leave no token to sample"):
            check_allowed_tokens(sp, bad, {7})


def test_engine_refuses_allowed_eos_only_under_min_tokens_and_keeps_serving(tiny_model_dir):
    """Before: the row was all -inf and token 0 came out, outside allowed_token_ids."""
    from fxrewrite.errors import UserInputError
    from fxrewrite.runtime.llm import LLM

    llm = LLM(str(tiny_model_dir("qwen3")), dtype="float32", max_model_len=64)
    eos = llm.get_tokenizer().eos_token_id
    with pytest.raises(UserInputError, match="leave no token to sample"):
        llm.generate("hi", SamplingParams(max_tokens=4, allowed_token_ids=[eos], min_tokens=2), use_tqdm=False)
    out = llm.generate("hi", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_bad_words_tokenized_ahead_are_used_until_the_words_change():
    """`update_from_tokenizer` (the server's tokenizer thread) tokenizes once; the engine reuses it, unless
    bad_words were edited since."""
    calls = []

    class Tok:
        def encode(self, text, add_special_tokens=False):
            calls.append(text)
            return [len(text)]

    sp = SamplingParams(bad_words=["ab", "cd"])
    sp.update_from_tokenizer(Tok())
    assert calls == ["ab", " ab", "cd", " cd"]
    assert sp.bad_words_token_ids(Tok()) == [[2], [3]] and len(calls) == 4  # deduplicated, not tokenized again
    assert sp.clone().bad_words_token_ids(Tok()) == [[2], [3]] and len(calls) == 4
    sp.bad_words = ["xyz"]
    assert sp.bad_words_token_ids(Tok()) == [[3], [4]] and calls[4:] == ["xyz", " xyz"]
