"""The LM head and greedy sampler captured at the end of small decode graphs (runtime/worker/greedy_head.py),
through the emulated graphs on a CPU (each bucket's replay runs what its graph would): the same tokens and
logprobs as the head run eagerly after the graph; the graph's tokens taken for plain greedy batches only (the
sampler runs on the graph's logits otherwise); buckets above MAX_BATCH, tensor-parallel and pooling runners keep
the head eager."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.engine import sampler as sampler_module
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.worker import greedy_head
from fxrewrite.runtime.worker.cuda_graphs import EMULATE_ENV

PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3", "a b c d e f"]


def _llm(path, monkeypatch, head: str, **kwargs):
    monkeypatch.setenv(EMULATE_ENV, "1")
    monkeypatch.setenv(greedy_head.ENV, head)
    kwargs = {"max_num_seqs": 20, **kwargs}
    return LLM(str(path), model_impl="native", dtype="float32", block_size=4, seed=0,
               kv_cache_memory_bytes=4 << 20, max_model_len=128, **kwargs)


def _summary(outputs):
    return [(c.token_ids, c.cumulative_logprob, [[(t, lp.logprob, lp.rank) for t, lp in d.items()]
                                                for d in (c.logprobs or [])])
            for out in outputs for c in out.outputs]


def _count_sampler_calls(monkeypatch) -> list:
    calls = []
    original = sampler_module.Sampler.sample

    def sample(self, logits, seqs, bitmask=None):
        calls.append(len(seqs))
        return original(self, logits, seqs, bitmask)

    monkeypatch.setattr(sampler_module.Sampler, "sample", sample)
    return calls


def record_samples(monkeypatch) -> list:
    """Every `SampledTokens.results()` call's [(token id, logprob)] appended to the returned list, in order."""
    seen = []
    original = sampler_module.SampledTokens.results

    def results(self):
        out = original(self)
        seen.append([(r.token_id, r.logprob) for r in out])
        return out

    monkeypatch.setattr(sampler_module.SampledTokens, "results", results)
    return seen


MIXED = [
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=3, repetition_penalty=1.2),
    SamplingParams(temperature=0, max_tokens=11, ignore_eos=True),
]


def test_graph_head_gives_the_eager_heads_tokens_and_logprobs(tiny_qwen3_dir, monkeypatch):
    """Plain greedy batches of 1, 4 and 18 sequences (the last in bucket 20, above MAX_BATCH: no head in its
    graph) and one mixed batch (logprobs, seeded top-p, penalties, min_tokens) give exactly what the engine
    gives with FXREWRITE_GRAPH_LOGITS=off."""
    greedy = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    batches = [(PROMPTS[:1], greedy), (PROMPTS, greedy), ((PROMPTS * 5)[:18], greedy), (PROMPTS, MIXED)]
    results, samples = {}, {}
    seen = record_samples(monkeypatch)
    for head in ("off", "on"):
        llm = _llm(tiny_qwen3_dir, monkeypatch, head)
        graphs = llm.llm_engine.model_runner.graph_runner
        assert sorted(graphs.heads) == ([1, 2, 4, 8, 16] if head == "on" else [])
        seen.clear()
        results[head] = [_summary(llm.generate(prompts, params, use_tqdm=False)) for prompts, params in batches]
        samples[head] = list(seen)
    for off, on, (prompts, _) in zip(results["off"], results["on"], batches):
        assert on == off, f"{len(prompts)} prompts: the graph's head differs from the eager one"
    assert len(results["on"][3][0][2]) == 10  # the logprobs asked for were returned
    # every step's (token, logprob) pairs, also where no logprobs were asked for (cumulative_logprob, RL)
    # (tokens exact; logprobs to float32 rounding: on some CPUs the bucket-padded logits' GEMM rounds a row's last bit
    # differently from the unpadded one)
    assert [[t for t, _ in step] for step in samples["on"]] == [[t for t, _ in step] for step in samples["off"]]
    torch.testing.assert_close([[lp for _, lp in step] for step in samples["on"]],
                               [[lp for _, lp in step] for step in samples["off"]], rtol=1e-5, atol=1e-6)
    assert len(samples["on"]) >= 30


def test_plain_greedy_decode_steps_skip_the_eager_sampler(tiny_qwen3_dir, monkeypatch):
    """With the head in the graph, a plain greedy batch calls the sampler for its prefill step only; a batch
    with logprobs (or above MAX_BATCH) calls it every step, on the graph's logits."""
    llm = _llm(tiny_qwen3_dir, monkeypatch, "on")
    calls = _count_sampler_calls(monkeypatch)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert calls == [4]  # the prefill step; its seven decode steps took the graph's tokens
    calls.clear()
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1), use_tqdm=False)
    assert calls == [4] * 8
    calls.clear()
    llm.generate((PROMPTS * 5)[:18], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert calls == [18] * 3


def test_a_row_that_does_not_sample_keeps_the_head_eager(tiny_qwen3_dir, monkeypatch):
    """A step of one-token rows where one row is a prompt's middle token (two tokens a step: one sequence
    decodes while the other's prompt goes in a token at a time) replays a graph, but its head rows are not the
    sampling rows: the runner runs the head eagerly on those rows, with the tokens the engine gives without it."""
    from fxrewrite.runtime.worker.cuda_graphs import CUDAGraphRunner

    prompts = ["a", "a b c d e f g h i j k l"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {}
    events = _count_sampler_calls(monkeypatch)  # (the number of sequences sampled), and ("graph", rows) below
    original = CUDAGraphRunner.head
    monkeypatch.setattr(CUDAGraphRunner, "head", lambda self, n: events.append(("graph", n)) or original(self, n))
    for head in ("off", "on"):
        llm = _llm(tiny_qwen3_dir, monkeypatch, head, max_num_batched_tokens=2, max_num_seqs=2)
        events.clear()
        outputs[head] = _summary(llm.generate(prompts, params, use_tqdm=False))
    assert outputs["on"] == outputs["off"]
    # while "a" decodes, the long prompt goes in a token a step: each such graph step samples one row eagerly
    pairs = list(zip(events, events[1:]))
    assert pairs.count((("graph", 2), 1)) == events.count(("graph", 2)) >= 3, events


def test_bad_switch_value_is_refused_at_engine_start(tiny_qwen3_dir, monkeypatch):
    with pytest.raises(UserInputError, match="FXREWRITE_GRAPH_LOGITS='yes': expected 'on'"):
        _llm(tiny_qwen3_dir, monkeypatch, "yes")


def test_no_head_for_pooling_runners(tiny_qwen3_dir, monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "1")
    llm = LLM(str(tiny_qwen3_dir), model_impl="native", dtype="float32", runner="pooling",
              kv_cache_memory_bytes=4 << 20, max_model_len=128, max_num_seqs=4)
    graphs = llm.llm_engine.model_runner.graph_runner
    assert graphs is not None and graphs.graphs and not graphs.heads


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_structured_outputs_sample_on_the_graphs_logits(tiny_qwen3_dir, monkeypatch, async_scheduling):
    """A JSON-constrained greedy request beside plain greedy ones: its grammar's bitmask applies to the graph's
    logits (a copy, when the mask is still being filled as the next step launches), with what the eager head
    gives."""
    import xgrammar  # noqa: F401 - the serve extra: missing is a setup fault, not a skip
    from fxrewrite.runtime.engine.structured_outputs import StructuredOutputsParams

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    constrained = SamplingParams(temperature=0, max_tokens=12,
                                 structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    params = [constrained, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 2
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    outputs = {}
    for head in ("off", "on"):
        llm = _llm(tiny_qwen3_dir, monkeypatch, head, async_scheduling=async_scheduling)
        outputs[head] = _summary(llm.generate(prompts, params, use_tqdm=False))
    assert outputs["on"] == outputs["off"]
    assert outputs["on"][0][0] != outputs["on"][1][0][: len(outputs["on"][0][0])]  # the grammar changed the tokens


def test_steady_decode_takes_the_previous_tokens_without_a_gather(tiny_qwen3_dir, monkeypatch):
    """Async scheduling: when every token of a graph step is the previous step's sample in the same row, the
    graph copies the previous step's tokens in as they are (no gather launches); when a sequence finishes the
    rows shift and the gather runs. Tokens equal those of synchronous scheduling (no tokens in flight)."""
    from fxrewrite.runtime.engine import inputs as inputs_module
    from fxrewrite.runtime.worker import model_runner

    in_order = []
    original = inputs_module.prepare_inputs

    def prepare(*args, **kwargs):
        step = original(*args, **kwargs)
        in_order.append((step.gather_dst is not None, step.gather_in_order))
        return step

    monkeypatch.setattr(model_runner, "prepare_inputs", prepare)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 9, 12, 7)]
    outputs = {}
    for mode in (False, True):
        llm = _llm(tiny_qwen3_dir, monkeypatch, "on", async_scheduling=mode)
        in_order.clear()
        outputs[mode] = _summary(llm.generate(PROMPTS, params, use_tqdm=False))
    assert outputs[True] == outputs[False]
    assert in_order.count((True, True)) >= 3 and in_order.count((True, False)) >= 2, in_order
