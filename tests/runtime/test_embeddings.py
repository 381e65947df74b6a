"""Embeddings from a causal LM (runner="pooling", vLLM's LAST pooling + L2 norm): `LLM.embed` equals
transformers' own final hidden state of the last prompt token, normalised (float32, 1e-5), for native
and transformers-backed models, one prompt alone or batched with others; bad input is refused."""

import pytest
import torch

from fxrewrite.runtime.engine.pooling import PoolingParams
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM

PROMPTS = ["The capital of France is", "Hello", "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3]


def _oracle(model_dir, token_ids: list[int], normalize: bool = True) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([token_ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=-1) if normalize else hidden


@pytest.fixture(scope="module")
def pooling_llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), model_impl="native", runner="pooling", dtype="float32",
               kv_cache_memory_bytes=4 << 20, max_model_len=128, max_num_batched_tokens=32)


def test_embed_equals_transformers_last_hidden_state(tiny_llama_dir, pooling_llm):
    outs = pooling_llm.embed(PROMPTS, use_tqdm=False)  # the long prompt is prefilled in chunks of 32
    tokenizer = pooling_llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer.encode(prompt)
        assert out.finished and out.prompt_token_ids == ids
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == (pooling_llm.llm_engine.model_config.hidden_size,)
        torch.testing.assert_close(got, _oracle(tiny_llama_dir, ids), rtol=1e-5, atol=1e-5)
        assert abs(got.norm().item() - 1.0) < 1e-5
    assert pooling_llm.embed([], use_tqdm=False) == []  # as generate([])
    again = pooling_llm.embed(PROMPTS[0], use_tqdm=False)[0]  # prefix-cached prompt: same embedding
    torch.testing.assert_close(torch.tensor(again.outputs.embedding), torch.tensor(outs[0].outputs.embedding))
    raw = pooling_llm.embed([ids], PoolingParams(normalize=False), use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), _oracle(tiny_llama_dir, ids, False),
                               rtol=1e-5, atol=1e-5)
    bm = pooling_llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not pooling_llm.llm_engine._embeddings


def test_transformers_backend_embeds_too(tiny_qwen3_dir):
    llm = LLM(str(tiny_qwen3_dir), model_impl="transformers", runner="pooling", dtype="float32",
              kv_cache_memory_bytes=4 << 20, max_model_len=64)
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    got = torch.tensor(llm.embed([ids], use_tqdm=False)[0].outputs.embedding)
    torch.testing.assert_close(got, _oracle(tiny_qwen3_dir, ids), rtol=1e-5, atol=1e-5)


def test_bad_input_and_wrong_runner(tiny_llama_dir, pooling_llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        pooling_llm.embed([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="200 tokens, more than max_model_len=128"):
        pooling_llm.embed([[5] * 200], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions=8 is not supported: this model does not support matryoshka"):
        pooling_llm.embed(["x"], PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(TypeError, match="dimensions='8' must be an integer"):
        PoolingParams(dimensions="8")
    with pytest.raises(ValueError, match="call LLM.embed"):
        pooling_llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="expected PoolingParams"):
        pooling_llm.llm_engine.add_request("r", "x", SamplingParams())
    with pytest.raises(ValueError, match="runner.*is not one of"):
        LLM(str(tiny_llama_dir), runner="embed")
    with pytest.raises(ValueError, match="data_parallel_size must be 1"):
        LLM(str(tiny_llama_dir), runner="pooling", data_parallel_size=2)
    assert not pooling_llm.llm_engine.has_unfinished_requests()


def test_embed_takes_vllm_dict_prompts(pooling_llm):
    """TokensPrompt / TextPrompt dicts, as LLM.generate takes them."""
    ids = [5, 9, 3]
    want = pooling_llm.embed([ids], use_tqdm=False)[0].outputs.embedding
    got = pooling_llm.embed([{"prompt_token_ids": ids}], use_tqdm=False)[0].outputs.embedding
    assert got == want
    with pytest.raises(ValueError, match="has neither 'prompt' nor 'prompt_token_ids'"):
        pooling_llm.embed([{"text": "x"}], use_tqdm=False)


def test_generate_llm_refuses_embed(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), model_impl="native", kv_cache_memory_bytes=1 << 20, max_model_len=64)
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.embed(["x"], use_tqdm=False)
    with pytest.raises(ValueError, match="PoolingParams need an engine made with runner='pooling'"):
        llm.llm_engine.add_request("r", "x", PoolingParams())


def test_embed_truncates_prompts_as_vllm(tiny_llama_dir, pooling_llm):
    """vLLM's LLM.embed(..., truncate_prompt_tokens=k) (and PoolingParams' field): the embedding of each prompt's
    last k tokens; -1 keeps max_model_len of them, and a k past max_model_len is refused."""
    ids = list(range(5, 205))
    out = pooling_llm.embed([ids], use_tqdm=False, truncate_prompt_tokens=7)[0]
    assert out.prompt_token_ids == ids[-7:]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), _oracle(tiny_llama_dir, ids[-7:]),
                               rtol=1e-5, atol=1e-5)
    whole = pooling_llm.embed([ids], PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids[-128:]
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens=129 must be -1 or in \[1, 128\]"):
        pooling_llm.embed([ids], use_tqdm=False, truncate_prompt_tokens=129)
    with pytest.raises(TypeError, match="truncate_prompt_tokens='7' must be an integer or None"):
        PoolingParams(truncate_prompt_tokens="7")
    with pytest.raises(ValueError, match=r"PoolingParams: truncate_prompt_tokens=0 must be -1"):
        pooling_llm.embed([ids], use_tqdm=False, truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="truncate_prompt_tokens=5 and pooling_params' truncate_prompt_tokens=3 differ"):
        pooling_llm.embed([ids], PoolingParams(truncate_prompt_tokens=3), use_tqdm=False, truncate_prompt_tokens=5)
    assert not pooling_llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("overrides", [{"is_matryoshka": True}, {"matryoshka_dimensions": [16, 32]}])
def test_matryoshka_dimensions_as_vllm(tiny_llama_dir, overrides):
    """A model whose config says is_matryoshka or lists matryoshka_dimensions (hf_overrides, as vLLM documents) takes
    PoolingParams(dimensions=k): the first k values of the hidden state, normalised after the cut (vLLM's order);
    a size outside the list or past the hidden size is refused (dimensions was refused for every model)."""
    llm = LLM(str(tiny_llama_dir), model_impl="native", runner="pooling", dtype="float32", hf_overrides=overrides,
              kv_cache_memory_bytes=1 << 20, max_model_len=64)
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    got = torch.tensor(llm.embed([ids], PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.embedding)
    want = torch.nn.functional.normalize(_oracle(tiny_llama_dir, ids, False)[:16], dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    bad = r"only supports \[16, 32\]" if "matryoshka_dimensions" in overrides else r"must be in \[1, 64\]"
    with pytest.raises(ValueError, match=bad):
        llm.embed([ids], PoolingParams(dimensions=65), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def _sentence_transformers_dir(tmp_path, model_dir, pooling: dict, dense: bool = False):
    """A copy of `model_dir` with Sentence Transformers' modules.json and 1_Pooling/config.json (`pooling`)."""
    import json
    import shutil

    folder = shutil.copytree(model_dir, tmp_path / "st")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if dense:
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))
    return folder


@pytest.mark.parametrize("pooling, dense, refused", [
    ({"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}, False, None),  # Qwen3-Embedding's
    ({"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}, False, "sets pooling_mode_mean_tokens"),
    ({"pooling_mode_cls_token": True}, False, "sets pooling_mode_cls_token"),
    ({"pooling_mode_lasttoken": True}, True, "has a Dense module"),
])
def test_sentence_transformers_pooling_other_than_last_is_refused(tmp_path, tiny_llama_dir, pooling, dense, refused):
    """modules.json's Pooling mode is what vLLM pools by; LAST is the only one here, so a MEAN / CLS model (or one
    with a Dense projection) is refused before its weights load, not embedded by its last token silently."""
    from fxrewrite.runtime.engine.pooling import check_sentence_transformers_pooling

    folder = _sentence_transformers_dir(tmp_path, tiny_llama_dir, pooling, dense)
    if refused is None:
        check_sentence_transformers_pooling(folder)
        return
    with pytest.raises(ValueError, match=refused):
        LLM(str(folder), model_impl="native", runner="pooling", kv_cache_memory_bytes=1 << 20, max_model_len=64)
    LLM(str(folder), model_impl="native", kv_cache_memory_bytes=1 << 20, max_model_len=64)  # generating: not read
