"""Per-request checks before queueing: features the multi-process executors lack are refused up front."""

from __future__ import annotations

import types

import pytest

from fxrewrite.runtime.engine.request_extras import check_request_extras
from fxrewrite.runtime.engine.sampling_params import SamplingParams, StructuredOutputsParams


def _config(tp=1, pp=1, dp=1, max_logprobs=20):
    return types.SimpleNamespace(max_logprobs=max_logprobs, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                 data_parallel_size=dp)


@pytest.mark.parametrize("sizes", [dict(tp=2), dict(pp=2), dict(dp=2)])
def test_structured_outputs_refused_with_any_parallelism(sizes):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    with pytest.raises(ValueError, match="structured_outputs is not supported with tensor, pipeline or data"):
        check_request_extras(params, _config(**sizes), 100)
    check_request_extras(params, _config(), 100)  # one process: fine


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


@pytest.mark.parametrize("extra", [{"min_tokens": 3}, {"allowed_token_ids": [1, 2]}, {"bad_words": ["a"]}])
def test_structured_outputs_refuse_what_could_mask_every_token(extra):
    """min_tokens (EOS masked), allowed_token_ids and bad_words with a grammar could leave a row no token: refused up
    front (a step with such a row used to fail every request in the batch)."""
    from fxrewrite.errors import UserInputError

    with pytest.raises(UserInputError, match=f"{next(iter(extra))}=.*cannot be combined with structured_outputs"):
        SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex="a"), **extra)
