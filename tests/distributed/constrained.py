"""Structured outputs, bad_words and prompt_logprobs across processes, checked inside the parallel tests that already
start an engine and its one-process reference (`check_constrained`): the driver fills each step's grammar mask and
sends it with the step (`step_messages.attach_bitmask`), and a new sequence's bad words as it tokenized them; the
workers sample under both and send prompt logprobs back with the tokens (`worker.StepResult`)."""

from __future__ import annotations

import json

import pytest

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.engine.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPTS = ["Hello, my name is", "1 2 3 4 5", "Write JSON:"]


def _bad_words(one) -> list[str]:
    """Two words the one-process engine's unconstrained greedy answer to the third prompt contains."""
    out = one.generate(PROMPTS[2:], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    words = [one.get_tokenizer().decode([t]).strip() for t in out.outputs[0].token_ids]
    words = [w for w in dict.fromkeys(words) if w]
    assert len(words) >= 2, words
    return words[:2]


def _outputs(llm, bad_words: list[str]) -> list:
    """The three answers (JSON schema, choice, bad words + prompt_logprobs=2), then the third prompt's logprobs."""
    params = [SamplingParams(temperature=0, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
              SamplingParams(temperature=0, max_tokens=10,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"])),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=bad_words, prompt_logprobs=2)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    prompt_logprobs = outs[2].prompt_logprobs
    assert prompt_logprobs is not None and prompt_logprobs[0] is None and len(prompt_logprobs) > 2
    # a rank in the tail of this flat random model's distribution moves with the reduction order (34,180 under TP=2,
    # 34,181 in one process, on an Intel Xeon): ranks are equal to 0.1% (so the leading ones exactly)
    logprobs = [(t, pytest.approx(d[t].logprob, abs=1e-4), pytest.approx(d[t].rank, rel=1e-3), sorted(d)) for t, d in
                zip(outs[2].prompt_token_ids[1:], prompt_logprobs[1:])]
    return [o.outputs[0].text for o in outs] + [logprobs]


def check_constrained(llm, one) -> None:
    """`llm` (TP, PP or DP) answers constrained requests as the one-process engine `one` does, and refuses an invalid
    schema without harm."""
    bad_words = _bad_words(one)
    want = _outputs(one, bad_words)
    got = _outputs(llm, bad_words)
    assert got == want
    if got[0].endswith("}"):  # finished within max_tokens: valid against the schema
        assert set(json.loads(got[0])) == {"name", "age"}
    assert got[1] in ("yes", "no", "maybe") and not any(word in got[2] for word in bad_words)
    with pytest.raises(UserInputError, match="invalid json for structured outputs"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "bogus"})),
                     use_tqdm=False)
    choice = SamplingParams(temperature=0, max_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert llm.generate(PROMPTS[1:2], choice, use_tqdm=False)[0].outputs[0].text in ("yes", "no")  # still serving
