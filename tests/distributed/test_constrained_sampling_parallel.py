"""Structured outputs, bad_words and prompt_logprobs with tensor, pipeline and data parallelism (gloo, 2 CPU ranks):
the driver fills each step's grammar mask and sends it with the step (`step_messages.attach_bitmask`), and a new
sequence's bad words as the driver tokenized them; the workers sample under both and send prompt logprobs back with
the tokens (`worker.StepResult`). Greedy tokens equal the one-process engine's, for a JSON schema, a choice and bad
words, prompt logprobs its values (float32, 1e-4), and an invalid schema is refused without harm."""

from __future__ import annotations

import json

import pytest

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.engine.sampling_params import SamplingParams, StructuredOutputsParams
from tests.distributed.tp_ranks import make_llm

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPTS = ["Hello, my name is", "1 2 3 4 5", "Write JSON:"]
BAD_WORDS = ["Metric", "trimming"]  # in the unconstrained greedy answer to the third prompt (" ... trimming joyousMetric")


def _params():
    json_schema = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    choice = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    return [SamplingParams(temperature=0, max_tokens=40, structured_outputs=json_schema),
            SamplingParams(temperature=0, max_tokens=10, structured_outputs=choice),
            SamplingParams(temperature=0, max_tokens=12, bad_words=BAD_WORDS, prompt_logprobs=2)]  # no grammar


def _texts(llm):
    """The three answers' texts, then the third prompt's logprobs [(token, logprob, rank)] and top-2 ids."""
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    prompt_logprobs = outs[2].prompt_logprobs
    assert prompt_logprobs is not None and prompt_logprobs[0] is None and len(prompt_logprobs) > 2
    token_ids = outs[2].prompt_token_ids
    logprobs = [(t, pytest.approx(d[t].logprob, abs=1e-4), d[t].rank, sorted(d)) for t, d in
                zip(token_ids[1:], prompt_logprobs[1:])]
    return [o.outputs[0].text for o in outs] + [logprobs]


@pytest.fixture(scope="module")
def reference(tiny_qwen3_dir):
    return _texts(make_llm(str(tiny_qwen3_dir), "native"))


@pytest.mark.parametrize("sizes", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                                   {"data_parallel_size": 2}])
def test_constrained_greedy_equals_one_process(tiny_qwen3_dir, reference, sizes):
    llm = make_llm(str(tiny_qwen3_dir), "native", **sizes)
    try:
        texts = _texts(llm)
        assert texts == reference
        if texts[0].endswith("}"):  # finished within max_tokens: valid against the schema
            assert set(json.loads(texts[0])) == {"name", "age"}
        assert texts[1] in ("yes", "no", "maybe")
        assert not any(word in texts[2] for word in BAD_WORDS)
        with pytest.raises(UserInputError, match="invalid json for structured outputs"):
            llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "bogus"})),
                         use_tqdm=False)
        assert _texts(llm) == reference  # still serving, nothing left behind
    finally:
        engine = llm.llm_engine  # a DPLLMEngine shuts its executor down; an LLMEngine's runner is the executor
        (engine.shutdown if hasattr(engine, "shutdown") else engine.model_runner.shutdown)()
