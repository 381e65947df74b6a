"""RequestOutputKind (vLLM's): DELTA outputs add up, step by step, to the CUMULATIVE ones; FINAL_ONLY gives one."""

import pytest

from fxrewrite.errors import UserTypeError
from fxrewrite.runtime.engine.sampling_params import RequestOutputKind, SamplingParams
from fxrewrite.runtime.llm import LLM

PROMPTS = ["The capital of France is a city where many people live and work every day of the", "1 2 3"]


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir):
    # 16 tokens a step: the long prompt runs in chunks (prompt logprobs filled over several steps); no prefix cache,
    # so every run of the same requests is scheduled alike
    return LLM(str(tiny_qwen3_dir), model_impl="native", dtype="float32", block_size=4, max_num_batched_tokens=16,
               max_num_seqs=4, enable_prefix_caching=False).llm_engine


def _run(engine, kind: RequestOutputKind, stop: list[str]) -> list[list]:
    """Each step's outputs [(request_id, RequestOutput)] for the two prompts under `kind`."""
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(n=2, temperature=0.8, seed=7 + i, max_tokens=12, ignore_eos=True, logprobs=1,
                                prompt_logprobs=1, stop=stop, output_kind=kind)
        engine.add_request(str(i), prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        steps.append([(o.request_id, o) for o in engine.step()])
    return steps


@pytest.mark.parametrize("stop", [[], ["e"]])
def test_delta_outputs_add_up_to_the_cumulative_ones(engine, stop):
    """Same requests (n=2, seeded sampling, logprobs, prompt logprobs over a chunked prompt, and a stop string whose
    held-back text must never be taken back): after every step, the deltas received so far, joined, equal that
    step's cumulative output; prompt logprobs come once, whole."""
    cumulative = _run(engine, RequestOutputKind.CUMULATIVE, stop)
    delta = _run(engine, RequestOutputKind.DELTA, stop)
    assert [[rid for rid, _ in step] for step in delta] == [[rid for rid, _ in step] for step in cumulative]
    joined, prompt_lps = {}, {}
    for step_d, step_c in zip(delta, cumulative, strict=True):
        for (rid, d), (_, c) in zip(step_d, step_c, strict=True):
            assert d.finished == c.finished and d.prompt_token_ids == c.prompt_token_ids
            if d.prompt_logprobs is not None:
                assert rid not in prompt_lps and d.prompt_logprobs == c.prompt_logprobs and None not in d.prompt_logprobs[1:]
                prompt_lps[rid] = d.prompt_logprobs
            for dc, cc in zip(d.outputs, c.outputs, strict=True):
                text, tokens, logprobs = joined.get((rid, dc.index), ("", [], []))
                joined[rid, dc.index] = (text + dc.text, tokens + dc.token_ids, logprobs + dc.logprobs)
                assert joined[rid, dc.index] == (cc.text, cc.token_ids, cc.logprobs), (rid, dc.index)
                assert (dc.finish_reason, dc.stop_reason, dc.cumulative_logprob) == (
                    cc.finish_reason, cc.stop_reason, cc.cumulative_logprob)
    assert sorted(prompt_lps) == ["0", "1"]
    first = next(out for step in delta for rid, out in step if rid == "0")
    assert first.prompt_logprobs is None and not first.outputs[0].token_ids  # a chunk of the prompt: not yet whole
    assert all(tokens for _, tokens, _ in joined.values())
    if stop:  # the stop string really stopped a completion
        assert any(c.finish_reason == "stop" for step in cumulative for _, out in step for c in out.outputs)


def test_final_only_kind_gives_one_output(engine):
    engine.add_request("f", PROMPTS[1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                        output_kind=RequestOutputKind.FINAL_ONLY))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].token_ids) == 5


def test_output_kind_must_be_one_of_the_enum():
    with pytest.raises(UserTypeError, match="output_kind='delta' must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA


def test_an_id_taken_again_gets_nothing_of_the_step_its_old_request_left_in_flight(engine):
    """A stop string ends a request (n=2) while the next step is already launched (async scheduling), and a new
    request takes the id at once (n=1): that step's completion gives no output for the new request (it gave an
    empty one, read off the old request's sequences) and the new request's outputs are its own."""
    old = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, stop=["e"])
    for _ in range(5):  # until the stop string ends it early, with a step in flight
        engine.add_request("a", PROMPTS[1], old)
        while engine.has_unfinished_requests():
            engine.step()
        if engine._inflight is not None:
            break
        old = SamplingParams(n=2, temperature=0.8, seed=old.seed + 1, max_tokens=12, ignore_eos=True, stop=["e"])
    assert engine._inflight is not None
    engine.add_request("a", PROMPTS[1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [len(o.outputs) for o in outs] == [1] * len(outs)
    assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 4))  # one new token an output, from the first


def test_add_request_takes_vllms_prompt_dicts(engine):
    """vLLM's `LLMEngine.add_request(request_id, prompt, params)` takes TextPrompt / TokensPrompt dicts (its
    PromptType); here they were a UserTypeError "prompt must be a string or a list of token ids, got dict"."""
    ids = engine.tokenizer.encode("1 2 3")
    params = SamplingParams(temperature=0, max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY)
    for rid, prompt in (("text", "1 2 3"), ("d-text", {"prompt": "1 2 3"}), ("d-ids", {"prompt_token_ids": ids})):
        engine.add_request(rid, prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
    assert outs["d-ids"].prompt_token_ids == outs["d-text"].prompt_token_ids == ids
    assert outs["d-ids"].outputs[0].token_ids == outs["d-text"].outputs[0].token_ids == outs["text"].outputs[0].token_ids
    with pytest.raises(ValueError, match="has neither 'prompt' nor 'prompt_token_ids'"):
        engine.add_request("bad", {"text": "1 2 3"}, params)
    with pytest.raises(ValueError, match="prompt_token_ids must be a list of token ids"):
        engine.add_request("bad", {"prompt_token_ids": "1 2 3"}, params)
    assert not engine.has_unfinished_requests()
