"""Structured outputs' grammar work in the grammar process: with async scheduling, a step's job (accepting
the previous step's tokens, filling this step's bitmask) is sent after the step's forward pass is launched,
runs there while the main thread completes the previous step, and is read before the step samples; seeded
outputs equal those of the sequential path (the matchers in this process) and of synchronous scheduling; a
grammar violation found there is raised on the main thread; a dead grammar process fails only the requests
whose matchers it held (the others, in the same step too, go on) and the next constrained request gets a fresh
one."""

import json
from types import SimpleNamespace

import pytest
import torch

from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.structured_outputs import StructuredOutputsParams
from fxrewrite.runtime.llm import LLM

import xgrammar  # noqa: E402,F401 - the serve extra (`make setup` installs it): missing is a setup fault
import jsonschema  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[A-Za-z][a-z]{0,7}$"},
                   "n": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"], "additionalProperties": False,
}
ENDLESS = {"type": "array", "items": {"type": "integer"}, "minItems": 1000}
"""Never completes within max_tokens: every step of every request has a row to fill."""


def _llm(model_dir, **kwargs):
    return LLM(str(model_dir), model_impl="native", kv_cache_memory_bytes=8 << 20, max_model_len=160,
               max_num_seqs=32, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return _llm(tiny_llama_dir)


def _constraint(**kwargs):
    return StructuredOutputsParams(disable_any_whitespace=True, **kwargs)


def test_job_is_sent_after_the_forward_launch_and_read_when_the_step_samples(llm):
    """Order per decode step: forward launched < job sent < the previous step completed (its samples
    processed) < the job's answer read < sample (in the next launch)."""
    engine = llm.llm_engine
    runner = engine.model_runner
    structured = engine.compile_structured_outputs(
        SamplingParams(structured_outputs=_constraint(json=ENDLESS))) and engine._structured
    assert structured.process is not None
    events = []

    def record(obj, name, kind):
        original = getattr(obj, name)

        def wrapper(*args, **kwargs):
            events.append(kind)
            return original(*args, **kwargs)
        return wrapper

    patches = [(runner.model, "compute_logits", "forward"), (runner.sampler, "sample", "sample"),
               (engine, "_process_sample", "process"), (structured, "start_step", "send"),
               (structured, "finish_step", "read"), (structured, "fill_bitmask", "fill_here")]
    for obj, name, kind in patches:
        setattr(obj, name, record(obj, name, kind))
    try:
        params = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=1,
                                structured_outputs=_constraint(json=ENDLESS))
        out = llm.generate(["numbers:"], params, use_tqdm=False)[0]
    finally:
        for obj, name, _ in patches:
            delattr(obj, name)
    assert all(len(c.token_ids) == 6 and c.text.startswith("[") for c in out.outputs)
    kinds = [k for i, k in enumerate(events) if k != "process" or events[i - 1] != "process"]
    # The prefill's mask is filled at once (no previous step); each decode step's job is sent after its
    # forward launch, the previous step completes meanwhile, and the answer is read when the step samples.
    decode = ["forward", "send", "process", "read", "sample"]
    assert kinds == ["forward", "fill_here", "sample"] + decode * 5 + ["process"], kinds
    assert structured.stats["job_s"] > 0 and structured.stats["wait_s"] <= structured.stats["main_s"]


def _requests():
    prompts = ["a", "b", "c", "d"]
    params = [
        SamplingParams(n=4, temperature=1.0, max_tokens=40, seed=3, structured_outputs=_constraint(json=SCHEMA)),
        SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=4),
        SamplingParams(n=3, temperature=1.0, max_tokens=20, seed=5, structured_outputs=_constraint(
            regex=r"[0-9]{2,5}-[a-z]{2}")),
        SamplingParams(n=2, temperature=0.0, max_tokens=10, structured_outputs=_constraint(choice=["yes", "no"])),
    ]
    return prompts, params


def _tokens(llm) -> list:
    outs = llm.generate(*_requests(), use_tqdm=False)
    for c in outs[0].outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


def test_seeded_outputs_equal_the_sequential_path_and_sync_scheduling(llm, tiny_llama_dir):
    overlapped = _tokens(llm)
    engine = llm.llm_engine
    in_process = engine._structured
    engine._structured = type(in_process)(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids,
                                          use_process=False)  # the matchers here, the work after completing
    try:
        assert _tokens(llm) == overlapped
    finally:
        engine._structured.close()
        engine._structured = in_process
    assert _tokens(_llm(tiny_llama_dir, async_scheduling=False)) == overlapped
    assert not engine._structured.constrained


def test_grammar_violation_is_raised_on_the_main_thread(llm):
    """A token the grammar refuses (a sampler bug) raises RuntimeError from finish_step."""
    engine = llm.llm_engine
    structured = engine.compile_structured_outputs(
        SamplingParams(structured_outputs=_constraint(choice=["a"]))) and engine._structured
    params = _constraint(choice=["yes", "no"])
    structured.add(-1, params)
    mask = structured.fill_bitmask([-1], torch.device("cpu"))
    bits = ((mask[0][:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[: structured.vocab_size]
    banned = int((bits == 0).nonzero()[0])
    try:
        job = structured.start_step([SimpleNamespace(seq_id=-1, is_finished=False)], [banned], [-1],
                                    torch.device("cpu"))
        with pytest.raises(RuntimeError, match="violates its grammar"):
            structured.finish_step(job, torch.device("cpu"))
    finally:
        structured.remove(-1)


def _kill(process) -> None:
    process._proc.kill()
    process._proc.wait()


def test_a_dead_grammar_process_fails_only_its_sequences_and_is_replaced(tiny_llama_dir):
    """The grammar process killed (as an OOM killer would): plain requests never touch it, a constrained request
    with no sequence left on the dead one starts a fresh one, and one that dies under running constrained sequences
    fails only those requests (their KV blocks freed), while a plain request of the same steps finishes; then it
    is replaced too (fresh-user reports: every later request, plain ones included, failed with a 500; later, the
    plain requests batched with the constrained ones when it died failed with them)."""
    llm = _llm(tiny_llama_dir)
    engine = llm.llm_engine
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=2, structured_outputs=_constraint(json=ENDLESS))
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = llm.generate(["hello"], plain, use_tqdm=False)[0].outputs[0].token_ids
    llm.generate(["numbers:"], params, use_tqdm=False)
    structured = engine._structured
    first = structured.process
    _kill(first)
    assert llm.generate(["hello"], plain, use_tqdm=False)[0].outputs[0].token_ids == expected
    out = llm.generate(["numbers:"], params, use_tqdm=False)[0]
    assert structured.process is not first and structured.process.alive()
    assert all(len(c.token_ids) == 8 and c.text.startswith("[") for c in out.outputs)

    for steps_before_kill in (1, 3):  # a prefill step in flight, then decode steps
        engine.add_request("constrained", "numbers:", params)
        engine.add_request("plain", "hello", plain)
        outputs = {}
        for _ in range(steps_before_kill):
            outputs.update((o.request_id, o) for o in engine.step())
        _kill(structured.process)
        failed = {}
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, o) for o in engine.step())
            failed.update(engine.take_failed_requests())
        assert list(failed) == ["constrained"] and "grammar process" in failed["constrained"]
        assert outputs["plain"].finished and outputs["plain"].outputs[0].token_ids == expected
        assert not engine.requests and not structured.constrained and not structured.lost
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    out = llm.generate(["numbers:"], params, use_tqdm=False)[0]  # a fresh grammar process again
    assert all(len(c.token_ids) == 8 and c.text.startswith("[") for c in out.outputs)

    engine.add_request("constrained", "numbers:", params)  # dead between steps, found by the next request's add
    engine.step()
    _kill(structured.process)
    engine.add_request("second", "numbers:", params)
    failed, outputs = {}, {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
        failed.update(engine.take_failed_requests())
    assert list(failed) == ["constrained"] and outputs["second"].finished
    assert all(c.text.startswith("[") for c in outputs["second"].outputs)

    step, killed = engine.step, []  # offline: the call whose request it held raises, naming it

    def step_then_kill():
        outputs = step()
        if not killed:
            killed.append(_kill(structured.process))
        return outputs

    engine.step = step_then_kill
    with pytest.raises(RuntimeError, match=r"request \d+: structured outputs failed: the grammar process is gone"):
        llm.generate(["hello", "numbers:"], [plain, params], use_tqdm=False)
    del engine.step
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    structured.close()
