"""Structured outputs' grammar work off the main thread: with async scheduling, a step's grammar work (accepting
the previous step's tokens, filling this step's bitmask) starts after the step's forward pass is launched, runs
on a worker thread while the main thread completes the previous step, and ends before the step samples;
seeded outputs equal those of the sequential path (the behaviour before the overlap) and of synchronous
scheduling; a grammar violation found on the worker is raised on the main thread."""

import json
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.structured_outputs import StructuredOutputsParams
from fxrewrite.runtime.llm import LLM

pytest.importorskip("xgrammar", reason="structured outputs need the serve extra (xgrammar)")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[A-Za-z][a-z]{0,7}$"},
                   "n": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"], "additionalProperties": False,
}
ENDLESS = {"type": "array", "items": {"type": "integer"}, "minItems": 1000}
"""Never completes within max_tokens: every step of every request has a row to fill."""
WAIT_S = 20.0


def _llm(model_dir, **kwargs):
    return LLM(str(model_dir), model_impl="native", kv_cache_memory_bytes=8 << 20, max_model_len=160,
               max_num_seqs=32, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return _llm(tiny_llama_dir)


def _constraint(**kwargs):
    return StructuredOutputsParams(disable_any_whitespace=True, **kwargs)


def test_fill_runs_after_the_forward_launch_beside_the_previous_steps_completion(llm):
    """Order per step: forward launched < grammar fill < sample (in the next launch). The fill runs on a
    worker thread, and it
    and the main thread's completion of the previous step are in progress at the same time: each waits
    for the other to have started (a sequential implementation would time out here)."""
    engine = llm.llm_engine
    runner, structured = engine.model_runner, engine.compile_structured_outputs(
        SamplingParams(structured_outputs=_constraint(json=ENDLESS))) and engine._structured
    events, fill_started, processing, job_fills = [], threading.Event(), threading.Event(), [False]
    overlapped = []
    main = threading.current_thread()

    def record(obj, name, before):
        original = getattr(obj, name)

        def wrapper(*args, **kwargs):
            before(*args, **kwargs)
            return original(*args, **kwargs)
        return wrapper

    def on_fill(*args, **kwargs):
        events.append(("fill", threading.current_thread() is main))
        fill_started.set()
        if threading.current_thread() is not main:
            overlapped.append(processing.wait(WAIT_S))

    def on_process(*args, **kwargs):
        if job_fills[0] and not processing.is_set():
            overlapped.append(fill_started.wait(WAIT_S))
            processing.set()

    def start(*args, **kwargs):
        fill_started.clear()
        processing.clear()
        job = original_start(*args, **kwargs)
        job_fills[0] = job.host is not None
        return job

    filler, original_start = structured._filler, structured.start_step
    filler.num_threads = 1  # one fill call per step (several threads split the rows)
    patches = [
        (runner, "execute_model_async", record(runner, "execute_model_async", lambda *a, **k: events.append(
            ("launch", None)))),
        (runner.model, "compute_logits", record(runner.model, "compute_logits", lambda *a, **k: events.append(
            ("forward", None)))),
        (runner.sampler, "sample", record(runner.sampler, "sample", lambda *a, **k: events.append(
            ("sample", a[2] is not None)))),
        (engine, "_process_sample", record(engine, "_process_sample", on_process)),
        (structured, "start_step", start),
    ]
    filler._fill = record(filler, "_fill", on_fill)
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        params = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=1,
                                structured_outputs=_constraint(json=ENDLESS))
        out = llm.generate(["numbers:"], params, use_tqdm=False)[0]
    finally:
        del filler._fill
        for obj, name, _ in patches:
            delattr(obj, name)
    assert all(len(c.token_ids) == 6 and c.text.startswith("[") for c in out.outputs)
    kinds = [kind for kind, _ in events]
    # One prefill (its mask filled at once: no previous step) and five decode steps; a decode step samples
    # when its tokens are first needed, in the next launch (before that step's forward) or in the last
    # step's completion, so the main thread never waits for the mask inside the step's own launch.
    decode = ["launch", "forward", "fill"] + ["launch", "sample", "forward", "fill"] * 4 + ["sample"]
    assert kinds == ["launch", "forward", "fill", "sample"] + decode, kinds
    kinds = [kind for kind in kinds if kind != "launch"]
    assert kinds == ["forward", "fill", "sample"] * 6, kinds
    assert [on_main for kind, on_main in events if kind == "fill"] == [True] + [False] * 5  # prefill: no previous
    assert all(masked for kind, masked in events if kind == "sample")
    assert overlapped == [True] * 10  # five worker fills x (fill saw processing, processing saw the fill)


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


def test_seeded_outputs_equal_the_sequential_path_threads_and_sync_scheduling(llm, tiny_llama_dir):
    overlapped = _tokens(llm)
    llm.llm_engine._structured.overlap = False  # the path before the worker thread
    try:
        sequential = _tokens(llm)
    finally:
        llm.llm_engine._structured.overlap = True
    assert overlapped == sequential
    filler = llm.llm_engine._structured._filler
    threads, filler.num_threads = filler.num_threads, 3  # rows split over three worker threads
    try:
        assert _tokens(llm) == overlapped
    finally:
        filler.num_threads = threads
    assert _tokens(_llm(tiny_llama_dir, async_scheduling=False)) == overlapped
    assert not llm.llm_engine._structured.matchers


def test_worker_grammar_violation_is_raised_on_the_main_thread(llm):
    """A token the grammar refuses (a sampler bug) raises RuntimeError from finish_step; the GIL switch
    interval is restored once the job is joined."""
    engine = llm.llm_engine
    structured = engine._structured or engine.compile_structured_outputs(
        SamplingParams(structured_outputs=_constraint(choice=["a"]))) and engine._structured
    compiled = structured.compile(_constraint(choice=["yes", "no"]))
    structured.add(-1, compiled)
    interval = sys.getswitchinterval()
    mask = structured.fill_bitmask([-1], torch.device("cpu"))
    bits = ((mask[0][:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[: structured.vocab_size]
    banned = int((bits == 0).nonzero()[0])
    try:
        job = structured.start_step([SimpleNamespace(seq_id=-1, is_finished=False)], [banned], [-1],
                                    torch.device("cpu"))
        with pytest.raises(RuntimeError, match="violates its grammar"):
            structured.finish_step(job, torch.device("cpu"))
        assert sys.getswitchinterval() == interval
    finally:
        structured.remove(-1)
