"""Async scheduling (step n+1 launched before step n's tokens reach the host) changes nothing a user sees:
same tokens, texts, finish reasons and logprobs as the synchronous engine, no leaked KV blocks."""

import pytest
import torch

from fxrewrite.runtime.worker.kv_cache import bytes_per_block
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # runs first under xdist (tests/conftest.py)

PROMPTS = ["Hello, my name is", "The capital of France is a city where many people live and", "1 2 3", "a b"]


def _llm(path, async_scheduling, **kwargs):
    return LLM(path, model_impl="native", dtype="float32", block_size=4, seed=0,
               async_scheduling=async_scheduling, **kwargs)


def _summary(outputs):
    """Exact fields, and the logprobs apart (batches differ between the modes, so float32 sums may too)."""
    exact = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs] for out in outputs]
    logprobs = [
        [c.cumulative_logprob or 0.0] + [lp.logprob for d in (c.logprobs or []) for lp in d.values()]
        for out in outputs for c in out.outputs
    ]
    return exact, logprobs


def _params(stop_token):
    return [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=9, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=15, stop=[" b", "3"], min_tokens=2),
        SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=7, repetition_penalty=1.3,
                       presence_penalty=0.5),
    ]


@pytest.mark.parametrize("tight_cache", [False, True])
def test_async_equals_sync(tiny_qwen3_dir, tight_cache):
    """Greedy, seeded sampling (n=2), stop ids and strings, min_tokens, penalties and logprobs in one
    batch; with a cache of 10 blocks of 4 tokens the batch is preempted and recomputed too."""
    from fxrewrite.runtime.model_files.config import ModelConfig

    path = str(tiny_qwen3_dir)
    kwargs = {"max_num_batched_tokens": 8}
    if tight_cache:
        block = bytes_per_block(ModelConfig.from_pretrained(path, dtype="float32"), 4, torch.float32)
        kwargs["kv_cache_memory_bytes"] = 10 * block
    results = {}
    for mode in (False, True):
        llm = _llm(path, mode, **kwargs)
        # a stop token the greedy run actually produces, so the stop path is exercised
        stop_token = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].token_ids[2]
        results[mode] = _summary(llm.generate(PROMPTS, _params(stop_token), use_tqdm=False))
        if tight_cache:
            assert llm.llm_engine.scheduler.num_preemptions > 0
        bm = llm.llm_engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        assert llm.llm_engine._inflight is None
    assert results[True][0] == results[False][0]
    for a, b in zip(results[True][1], results[False][1]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)


def test_async_overlaps_and_skips_a_certain_last_step(tiny_qwen3_dir):
    """While step n runs, step n+1 is already launched; a sequence whose in-flight token is its last
    (max_tokens) is not scheduled again, so a batch of max_tokens=3 runs exactly prefill + 2 decodes."""
    llm = _llm(str(tiny_qwen3_dir), True)
    engine = llm.llm_engine
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    launches, outputs = [], []
    original = engine.model_runner.execute_model_async

    def counting(sched, previous=None):
        launches.append((len(sched.scheduled), previous is not None))
        return original(sched, previous)

    engine.model_runner.execute_model_async = counting
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert launches == [(1, False), (1, True), (1, True)]  # the 2nd and 3rd launched with one in flight
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 2, 3]
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"


def test_async_stop_drops_the_extra_token_and_abort_frees_blocks(tiny_qwen3_dir):
    """A stop string ends the sequence one step after the next was launched: the token computed for
    nothing is not reported; aborting with a step in flight frees every block, and the engine goes on."""
    llm = _llm(str(tiny_qwen3_dir), True)
    engine = llm.llm_engine
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    stop_id = greedy.token_ids[2]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:3] and out.finish_reason == "stop"

    engine.add_request("x", PROMPTS[1], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine._inflight is not None
    engine.abort_request("x")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.step()  # drains the aborted step: nothing to report
    again = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert again.token_ids == greedy.token_ids


@pytest.mark.parametrize("extra", [dict(frequency_penalty=0.5), dict(repetition_penalty=1.2), dict(bad_words=["zq"])])
def test_a_penalised_sequence_that_stops_leaves_the_next_batch(tiny_qwen3_dir, extra):
    """Penalties and bad words make a step wait for the previous one's tokens; a sequence that stops on one of
    them (here its first output token: every id stops it) must not stay in the step being launched, whose block
    table for it would be empty: alone that was an IndexError, in a batch its K/V went to block 0, another
    sequence's. The greedy neighbours' tokens equal theirs alone, and every block comes back."""
    llm = _llm(str(tiny_qwen3_dir), True)
    vocab = llm.llm_engine.model_config.vocab_size
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], greedy, use_tqdm=False)]
    stopper = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=list(range(vocab)), **extra)
    out = llm.generate(PROMPTS[2], stopper, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.text == "" and out.finish_reason == "stop"  # the stop id: no text
    mixed = llm.generate(PROMPTS[:2] + [PROMPTS[2], PROMPTS[3]], [greedy, greedy, stopper, stopper], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
