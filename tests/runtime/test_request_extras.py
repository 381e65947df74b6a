"""Per-request checks before queueing: features the multi-process executors lack are refused up front."""

from __future__ import annotations

import types

import pytest

from fxrewrite.runtime.engine.request_extras import check_request_extras
from fxrewrite.runtime.engine.sampling_params import SamplingParams, StructuredOutputsParams


def _config(tp=1, pp=1, dp=1):
    return types.SimpleNamespace(max_logprobs=20, tensor_parallel_size=tp, pipeline_parallel_size=pp,
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
