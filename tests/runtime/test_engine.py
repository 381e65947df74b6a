"""LLM / LLMEngine end to end on tiny real-architecture models (random weights) against transformers."""

import pytest
import torch

from fxrewrite.runtime.worker.kv_cache import bytes_per_block
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # runs first under xdist (tests/conftest.py)

PROMPTS = ["Hello, my name is", "The capital of France is a city where many people live and", "1 2 3"]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_greedy(tiny_model_dir):
    """Per arch: transformers' greedy continuation of each prompt (float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = {}

    def get(arch):
        if arch not in cache:
            path = tiny_model_dir(arch)
            tok = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            outs = []
            for prompt in PROMPTS:
                ids = tok(prompt, return_tensors="pt").input_ids
                gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                     attention_mask=torch.ones_like(ids))
                outs.append(gen[0, ids.shape[1]:].tolist())
            cache[arch] = outs
        return cache[arch]

    return get


def assert_no_leak(llm):
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def qwen3_llm(tiny_qwen3_dir):
    return LLM(str(tiny_qwen3_dir), model_impl="native", dtype="float32", block_size=4)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("impl, fusion", [("native", True), ("transformers", True), ("transformers", False)])
def test_greedy_equals_transformers_with_preemption_and_prefix_hits(tiny_model_dir, hf_greedy, arch, impl, fusion):
    """A KV cache of 8 blocks of 4 tokens cannot hold the batch: requests are preempted and
    recomputed; the second run of the same prompts hits the prefix cache. Tokens stay exact."""
    from fxrewrite.runtime.model_files.config import ModelConfig

    path = str(tiny_model_dir(arch))
    block_bytes = bytes_per_block(ModelConfig.from_pretrained(path, dtype="float32"), 4, torch.float32)
    llm = LLM(path, model_impl=impl, fusion=fusion, dtype="float32", block_size=4,
              kv_cache_memory_bytes=8 * block_bytes, max_num_batched_tokens=8)
    assert llm.llm_engine.model_runner.model.impl == impl
    expected = hf_greedy(arch)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions"] > 0
    assert_no_leak(llm)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] > 0
    assert_no_leak(llm)


def test_outputs_shape_text_and_finish_reason(qwen3_llm):
    out = qwen3_llm.generate("Hello, my name is", GREEDY, use_tqdm=False)[0]
    tok = qwen3_llm.get_tokenizer()
    assert out.prompt == "Hello, my name is" and out.prompt_token_ids == tok.encode("Hello, my name is")
    (completion,) = out.outputs
    assert completion.finish_reason == "length" and len(completion.token_ids) == MAX_TOKENS
    assert completion.text == tok.decode(completion.token_ids, skip_special_tokens=True)
    assert out.finished
    assert_no_leak(qwen3_llm)


def test_long_prompt_prefill_on_cpu_has_no_length_squared_scores(qwen3_llm, tiny_qwen3_dir):
    """A 2048-token prompt in one prefill step (4 heads): no op output of the step reaches [heads, L, L]
    (the CPU attention goes in query chunks / SDPA tiles); its greedy token is transformers' argmax."""
    from transformers import AutoModelForCausalLM

    from tests.kernels.test_paged_attention import LargestTensor

    length = 2048
    ids = torch.randint(0, 5000, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    with LargestTensor() as mode:
        out = qwen3_llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1),
                                 use_tqdm=False)[0]
    assert 0 < mode.largest < 4 * length * length
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
    assert out.outputs[0].token_ids == [int(logits.argmax())]
    assert_no_leak(qwen3_llm)


def test_seeded_sampling_is_reproducible_and_n2_gives_two_outputs(tiny_qwen3_dir):
    """A seeded request samples the same tokens in another batch order. Batch-invariant kernels: otherwise a row's
    logits change in the last bits with the rows beside it (the CPU GEMM's blocking follows M), and a sample near a
    tie flips (torch 2.13's CPU build did so at the 6th token of this case)."""
    llm = LLM(str(tiny_qwen3_dir), model_impl="native", dtype="float32", block_size=4, batch_invariant=True)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8, n=2, logprobs=2)
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    second = llm.generate(PROMPTS[::-1], params, use_tqdm=False)[::-1]
    for a, b in zip(first, second):
        assert [c.index for c in a.outputs] == [0, 1]
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert all(len(c.logprobs) == len(c.token_ids) for c in a.outputs)
        assert all(t in lp for c in a.outputs for t, lp in zip(c.token_ids, c.logprobs))
    assert_no_leak(llm)


def test_stop_string_cuts_text_exactly(qwen3_llm):
    full = qwen3_llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    out = qwen3_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop]),
                             use_tqdm=False)[0].outputs[0]
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert_no_leak(qwen3_llm)


def test_stop_string_waits_for_min_tokens(qwen3_llm):
    """As vLLM: a stop string in the first min_tokens tokens' text is not a stop; one after it is."""
    full = qwen3_llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0]
    first = qwen3_llm.llm_engine.tokenizer.decode(full.token_ids[:1])
    stop = first.strip()[:2] or first  # text the first token makes: a stop at once without min_tokens
    plain = qwen3_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop]),
                               use_tqdm=False)[0].outputs[0]
    assert plain.finish_reason == "stop" and len(plain.token_ids) == 1
    out = qwen3_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=4,
                                                         stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 4 and out.token_ids[:4] == full.token_ids[:4]
    later = full.text.find(stop, len(qwen3_llm.llm_engine.tokenizer.decode(full.token_ids[:4])))
    if later == -1:  # the stop string does not come back: the greedy text runs to max_tokens
        assert out.finish_reason == "length" and out.token_ids == full.token_ids
    else:
        assert out.finish_reason == "stop" and out.text == full.text[:later]
    assert_no_leak(qwen3_llm)


def test_stop_token_ids_and_min_tokens(qwen3_llm):
    greedy = qwen3_llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = greedy[0]
    out = qwen3_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                         stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [stop_id] and out.finish_reason == "stop" and out.stop_reason == stop_id
    out = qwen3_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=3,
                                                         stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 3 and stop_id not in out.token_ids[:3]
    assert_no_leak(qwen3_llm)


def test_bad_request_fails_alone_and_leaks_nothing(qwen3_llm):
    engine = qwen3_llm.llm_engine
    engine.add_request("good", PROMPTS[0], GREEDY)
    too_long = [1] * (engine.model_config.max_model_len + 1)
    with pytest.raises(ValueError, match=rf"{len(too_long)} tokens.*max_model_len={engine.model_config.max_model_len}"):
        engine.add_request("bad", too_long, GREEDY)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"] and len(finished[0].outputs[0].token_ids) == MAX_TOKENS
    with pytest.raises(ValueError, match="prompt 1"):
        qwen3_llm.generate([PROMPTS[0], too_long], GREEDY, use_tqdm=False)
    assert_no_leak(qwen3_llm)
    assert len(qwen3_llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == MAX_TOKENS


def test_model_error_frees_all_blocks(qwen3_llm, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(qwen3_llm.llm_engine.model_runner.model, "forward", boom)
    with pytest.raises(RuntimeError, match="boom"):
        qwen3_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_no_leak(qwen3_llm)


def test_abort_frees_blocks(qwen3_llm):
    engine = qwen3_llm.llm_engine
    engine.add_request("a", PROMPTS[1], GREEDY)
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.abort_request("a")
    assert_no_leak(qwen3_llm)


def test_config_errors(tiny_qwen3_dir):
    with pytest.raises(ValueError, match="model_impl='vllm'.*'auto', 'native', 'transformers'"):
        LLM(str(tiny_qwen3_dir), model_impl="vllm")
    with pytest.raises(TypeError, match="'no_such_arg'"):
        LLM(str(tiny_qwen3_dir), no_such_arg=1)
    with pytest.raises(ValueError, match="block_size=0 must be a positive integer"):
        LLM(str(tiny_qwen3_dir), block_size=0)
    for dtype in ("float64", "bf16"):  # one list, vLLM's (bf16 was offered, then refused by a second check)
        with pytest.raises(ValueError, match=rf"dtype='{dtype}' is not one of 'auto', 'float32', 'float16', "
                                             r"'bfloat16', 'half', 'float'$"):
            LLM(str(tiny_qwen3_dir), dtype=dtype)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1.5 must be in \(0, 1\]"):
        LLM(str(tiny_qwen3_dir), gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="device='tpu:0' is not a torch device"):
        LLM(str(tiny_qwen3_dir), device="tpu:0")
    with pytest.raises(ValueError, match="device='mps'.*'cpu' or 'cuda'"):
        LLM(str(tiny_qwen3_dir), device="mps")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda': this torch sees no CUDA device"):
            LLM(str(tiny_qwen3_dir), device="cuda")
    with pytest.raises(ValueError, match="top_p=1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="max_tokens=0 must be at least 1"):
        SamplingParams(max_tokens=0)


def test_generation_stops_at_max_model_len(tiny_qwen3_dir):
    llm = LLM(str(tiny_qwen3_dir), model_impl="native", dtype="float32", max_model_len=32, block_size=4)
    out = llm.generate([[1] * 30], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2 and out[0].outputs[0].finish_reason == "length"
    out = llm.generate([[1] * 32], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 1
    assert_no_leak(llm)


def test_max_tokens_past_max_model_len_is_capped_there(tiny_qwen3_dir):
    """New-user review F11: max_tokens=10**9 (or None) generates up to max_model_len and finishes with "length",
    as vLLM's offline API does (no KV blocks reserved for 10**9 tokens, none left in use); bad values are errors
    naming them, and the engine keeps serving after each."""
    llm = LLM(str(tiny_qwen3_dir), model_impl="native", dtype="float32", max_model_len=32, block_size=4)
    for max_tokens in (10**9, 10**30, None):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([[1] * 5, [2] * 20], params, use_tqdm=False)
        assert [(len(o.prompt_token_ids) + len(o.outputs[0].token_ids), o.outputs[0].finish_reason)
                for o in outs] == [(32, "length")] * 2
    with pytest.raises(ValueError, match="prompt 1: prompt has 33 tokens, more than max_model_len=32"):
        llm.generate([[1] * 3, [1] * 33], SamplingParams(max_tokens=10**9), use_tqdm=False)
    for bad, error, expected in ((0, ValueError, "max_tokens=0 must be at least 1"), (-1, ValueError, "at least 1"),
                                 (2.5, TypeError, "max_tokens=2.5 must be an integer"), ("5", TypeError, "integer"),
                                 (True, TypeError, "max_tokens=True must be an integer")):
        with pytest.raises(error, match=expected):
            SamplingParams(max_tokens=bad)
    assert_no_leak(llm)
    assert len(llm.generate([[1] * 3], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == MAX_TOKENS


def test_streamed_text_only_grows_with_stop_strings(qwen3_llm):
    full = qwen3_llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    engine, texts = qwen3_llm.llm_engine, []
    engine.add_request("s", PROMPTS[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop]))
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    assert all(texts[-1].startswith(t) for t in texts)
    assert texts[-1] == full[: full.index(stop)]
    assert_no_leak(qwen3_llm)


def test_too_many_logprobs_fails_alone(qwen3_llm):
    """A request asking for more logprobs than allowed (max_logprobs, 20 by default, as in vLLM) is
    refused at add_request; it used to pass and then fail the whole step, taking the other requests of
    the batch down with it."""
    engine = qwen3_llm.llm_engine
    vocab = engine.model_config.vocab_size
    engine.add_request("good", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match=rf"logprobs={vocab + 1} is more than max_logprobs=20"):
        engine.add_request("bad", PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, logprobs=vocab + 1))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"] and len(finished[0].outputs[0].token_ids) == MAX_TOKENS
    assert_no_leak(qwen3_llm)


def test_kv_cache_shorter_than_max_model_len_is_reported(tiny_qwen3_dir, caplog):
    """vLLM refuses to start then; we start (tests use tiny caches on purpose) but say which request
    lengths will be refused, instead of leaving a server to answer 400 to every long default request."""
    from fxrewrite.runtime.model_files.config import ModelConfig

    block_bytes = bytes_per_block(ModelConfig.from_pretrained(str(tiny_qwen3_dir), dtype="float32"), 4, torch.float32)
    with caplog.at_level("WARNING", logger="fxrewrite.runtime.engine.llm_engine"):
        llm = LLM(str(tiny_qwen3_dir), model_impl="native", dtype="float32", block_size=4,
                  kv_cache_memory_bytes=8 * block_bytes, max_model_len=100)
    assert "KV cache holds 32 tokens, less than max_model_len=100" in caplog.text
    with pytest.raises(ValueError, match="more than the whole KV cache holds"):
        llm.generate([[1] * 20], SamplingParams(max_tokens=20), use_tqdm=False)
    # max_tokens past max_model_len asks for max_model_len (generation stops there): the error says so (F11)
    with pytest.raises(ValueError, match=r"needs 99 KV cache slots \(prompt 3 \+ max_tokens 1000000000 - 1, the last "
                                         r"token is not cached, up to max_model_len=100\), more than the whole KV "
                                         r"cache holds \(32\); .* shorten max_tokens or max_model_len"):
        llm.generate([[1] * 3], SamplingParams(max_tokens=10**9), use_tqdm=False)
    with pytest.raises(ValueError, match=r"needs 44 KV cache slots \(prompt 40 \+ max_tokens 5 - 1.*shorten the prompt$"):
        llm.generate([[1] * 40], SamplingParams(max_tokens=5), use_tqdm=False)  # the prompt alone overflows it
    assert len(llm.generate([[1] * 3], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == MAX_TOKENS
    # without max_tokens a request runs until the cache is full (vLLM would not have started): 32 slots,
    # + 1 for the last sampled token; two at once take turns (preemption), and every block comes back
    assert llm.llm_engine.max_seq_len == 33
    unbounded = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    outs = llm.generate([[1] * 3, [2] * 20], unbounded, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [30, 13]
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
    with pytest.raises(ValueError, match=r"needs 33 KV cache slots \(prompt\), more than the whole KV cache holds"):
        llm.generate([[1] * 33], unbounded, use_tqdm=False)
    assert_no_leak(llm)


def test_final_only_requests_return_one_output_when_finished(qwen3_llm):
    """LLM.generate queues final_only requests (vLLM's FINAL_ONLY): no cumulative copy every step."""
    engine, params = qwen3_llm.llm_engine, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    engine.add_request("final", PROMPTS[0], params, final_only=True)
    engine.add_request("cumulative", PROMPTS[0], params)
    seen = {"final": [], "cumulative": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert [o.finished for o in seen["final"]] == [True]
    assert len(seen["cumulative"]) == 4 and seen["cumulative"][-1].finished
    final, last = seen["final"][0].outputs[0], seen["cumulative"][-1].outputs[0]
    assert final.token_ids == last.token_ids and final.text == last.text and len(final.logprobs) == 4
    assert_no_leak(qwen3_llm)


@pytest.mark.parametrize("include_stop", [False, True])
def test_final_only_text_decoded_once_equals_incremental(qwen3_llm, include_stop):
    """A final_only request without stop strings decodes its text once, at the end: the same text as the
    per-token incremental decode, the stop token's text left out unless include_stop_str_in_output."""
    engine = qwen3_llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    probe = qwen3_llm.generate([PROMPTS[1]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[probe[3]],
                            include_stop_str_in_output=include_stop)
    engine.add_request("final", PROMPTS[1], params, final_only=True)
    engine.add_request("cumulative", PROMPTS[1], params)
    last = {}
    while engine.has_unfinished_requests():
        last.update({o.request_id: o.outputs[0] for o in engine.step()})
    final, cumulative = last["final"], last["cumulative"]
    assert final.token_ids == cumulative.token_ids == probe[:4] and final.finish_reason == "stop"
    assert final.text == cumulative.text != ""
    assert_no_leak(qwen3_llm)


def test_detokenize_false_returns_token_ids_and_logprobs_without_text(qwen3_llm):
    """vLLM's detokenize=False: no text, logprob entries without decoded_token, same tokens; stop strings refused."""
    out = qwen3_llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1,
                                                          detokenize=False), use_tqdm=False)[0].outputs[0]
    ref = qwen3_llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1),
                             use_tqdm=False)[0].outputs[0]
    assert out.text == "" and out.token_ids == ref.token_ids and ref.text
    assert all(lp.decoded_token is None for step in out.logprobs for lp in step.values())
    # Same tokens; the logprobs within float32 rounding (the second prompt's prefill hits the prefix cache).
    assert [list(s) for s in out.logprobs] == [list(s) for s in ref.logprobs]
    assert [lp.logprob for s in out.logprobs for lp in s.values()] == \
        pytest.approx([lp.logprob for s in ref.logprobs for lp in s.values()], rel=1e-5)
    with pytest.raises(ValueError, match="detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    assert_no_leak(qwen3_llm)


def test_lone_surrogate_in_a_prompt_is_a_clear_error_and_the_engine_keeps_serving(qwen3_llm):
    from fxrewrite.runtime.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=r"prompt: character 1 is a lone UTF-16 surrogate \(U\+D800\)"):
        qwen3_llm.generate(["a\ud800b"], params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"conversation 0: .*lone UTF-16 surrogate \(U\+DFFF\)"):
        qwen3_llm.chat([{"role": "user", "content": "x\udfff"}], params, use_tqdm=False)
    assert len(qwen3_llm.generate(["a\U0001F600b"], params, use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_truncate_prompt_tokens_keeps_the_last_tokens(qwen3_llm):
    """vLLM's SamplingParams.truncate_prompt_tokens: the prompt's last k tokens are what the model sees (the
    same greedy tokens as those k given alone); -1 keeps max_model_len; more than max_model_len, 0 or -2 are
    errors naming the value."""
    ids = list(range(100, 140))
    kept = qwen3_llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, truncate_prompt_tokens=7),
                              use_tqdm=False)[0]
    alone = qwen3_llm.generate([ids[-7:]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    assert kept.prompt_token_ids == ids[-7:] and kept.outputs[0].token_ids == alone.outputs[0].token_ids
    whole = qwen3_llm.generate([ids], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids
    limit = qwen3_llm.llm_engine.model_config.max_model_len
    with pytest.raises(ValueError, match=rf"truncate_prompt_tokens={limit + 1} must be -1 or in \[1, {limit}\]"):
        qwen3_llm.generate([ids], SamplingParams(truncate_prompt_tokens=limit + 1), use_tqdm=False)
    for bad in (0, -2):
        with pytest.raises(ValueError, match=f"truncate_prompt_tokens={bad} must be -1 or at least 1"):
            SamplingParams(truncate_prompt_tokens=bad)
    assert_no_leak(qwen3_llm)
