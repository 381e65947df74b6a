"""prompt_logprobs, max_logprobs, stop-token text, logit_bias and bad_words on a tiny llama (SmolLM2
tokenizer), checked against transformers' own forward pass and the engine's own greedy tokens."""

import pytest
import torch

from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM

PROMPT = list(range(100, 140))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # 16-token steps: the 40-token prompt runs in three chunks.
    return LLM(str(tiny_llama_dir), model_impl="native", kv_cache_memory_bytes=2 << 20, max_model_len=256,
               max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)


def test_prompt_logprobs_match_transformers_across_chunks_and_prefix_cache(llm, hf_logprobs):
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3, n=2)
    # The second run finds the prompt's blocks in the prefix cache; prompt logprobs must skip it.
    for _ in range(2):
        out = llm.generate([PROMPT], params, use_tqdm=False)[0]
        pl = out.prompt_logprobs
        assert len(pl) == len(PROMPT) and pl[0] is None
        for p in range(1, len(PROMPT)):
            entry = pl[p]
            ref = hf_logprobs[p - 1]
            assert entry[PROMPT[p]].logprob == pytest.approx(ref[PROMPT[p]].item(), abs=1e-4)
            assert entry[PROMPT[p]].rank == int((ref > ref[PROMPT[p]]).sum()) + 1
            top = ref.topk(3).indices.tolist()
            assert set(top) <= set(entry) and len(entry) <= 4
            assert entry[top[0]].rank == 1


def test_no_prompt_logprobs_unless_asked(llm):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_logprobs is None


def test_max_logprobs_is_enforced_with_a_clear_error(llm):
    with pytest.raises(ValueError, match="logprobs=1000 is more than max_logprobs=20"):
        llm.generate([PROMPT], SamplingParams(logprobs=1000), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs=21 is more than max_logprobs=20"):
        llm.generate([PROMPT], SamplingParams(prompt_logprobs=21), use_tqdm=False)
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks


def _greedy(llm, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **kwargs)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]


def test_stop_token_text_is_left_out_unless_asked(llm):
    tok = llm.get_tokenizer()
    free = _greedy(llm)
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    out = _greedy(llm, stop_token_ids=[stop_at])
    assert out.token_ids == free.token_ids[: first + 1] and out.stop_reason == stop_at
    assert out.text == tok.decode(free.token_ids[:first])
    out = _greedy(llm, stop_token_ids=[stop_at], include_stop_str_in_output=True)
    assert out.text == tok.decode(free.token_ids[: first + 1])


def test_eos_text_is_left_out_with_skip_special_tokens_false(llm):
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=4, skip_special_tokens=False, logit_bias={eos: 100.0})
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.text == ""
    params.include_stop_str_in_output = True
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.text == tok.decode([eos], skip_special_tokens=False)


def test_logit_bias_and_bad_words(llm):
    tok = llm.get_tokenizer()
    forced = tok.encode(" Paris", add_special_tokens=False)[0]
    out = _greedy(llm, logit_bias={forced: 100.0})
    assert out.token_ids == [forced] * 8
    out = _greedy(llm, logit_bias={forced: 100.0}, bad_words=["Paris"])
    assert forced not in out.token_ids
    free = _greedy(llm)
    banned = free.token_ids[0]
    out = _greedy(llm, bad_words=[tok.decode([banned]).strip() or tok.decode([banned])])
    assert out.token_ids[0] != banned


def test_bad_input_names_the_field():
    with pytest.raises(TypeError, match="logit_bias"):
        SamplingParams(logit_bias={"a": 1})
    with pytest.raises(TypeError, match="bad_words"):
        SamplingParams(bad_words=[""])
    with pytest.raises(ValueError, match="prompt_logprobs=-1"):
        SamplingParams(prompt_logprobs=-1)
