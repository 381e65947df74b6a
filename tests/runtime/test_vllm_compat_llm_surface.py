"""vLLM's LLM surface beyond LLM(...): generate / chat keyword arguments accepted at vLLM's defaults and refused
(naming the feature) otherwise, chat_template_content_format, the vLLM methods this LLM lacks
(NotImplementedError naming what to use), and vLLM's TextPrompt / TokensPrompt / RequestOutputKind exports."""

import pytest

import fxrewrite
from fxrewrite import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=2, temperature=0)
CHAT = [{"role": "user", "content": "Name a colour."}]
# renders a string content as S:<text>, a list of parts as L:[<text>]...: shows which format the template got
SHOW_FORMAT = ("{% for m in messages %}{% if m.content is string %}S:{{ m.content }}{% else %}L:{% for p in "
               "m.content %}[{{ p.text }}]{% endfor %}{% endif %};{% endfor %}")


@pytest.fixture(scope="module")
def llm(tiny_qwen3_dir):
    return LLM(str(tiny_qwen3_dir), kv_cache_memory_bytes=1 << 22, max_model_len=256)


def test_vllm_defaults_are_accepted(llm):
    plain = llm.generate(["Hello"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate(["Hello"], GREEDY, use_tqdm=False, lora_request=None, priority=[0], tokenization_kwargs=None)
    assert out[0].outputs[0].token_ids == plain
    assert llm.generate(["Hello"], GREEDY, use_tqdm=False, priority=None, tokenization_kwargs={})
    assert llm.chat(CHAT, GREEDY, use_tqdm=False, lora_request=None, chat_template_content_format="auto",
                    mm_processor_kwargs=None)


@pytest.mark.parametrize("kwargs, words", [
    ({"lora_request": object()}, ["lora_request", "LoRA adapters are not supported", "merge"]),
    ({"priority": [3]}, ["priority=[3]", "first-come-first-served"]),
    ({"tokenization_kwargs": {"truncation": True}}, ["tokenization_kwargs", "token ids"]),
])
def test_generate_refuses_real_values_naming_the_feature(llm, kwargs, words):
    with pytest.raises(NotImplementedError) as e:
        llm.generate(["Hello"], GREEDY, use_tqdm=False, **kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()


def test_priority_must_be_one_integer_per_prompt(llm):
    with pytest.raises(ValueError, match=r"got 1 priorities for 2 prompts"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[0])
    with pytest.raises(TypeError, match=r"priority='high'.*list of integers"):
        llm.generate(["a"], GREEDY, use_tqdm=False, priority="high")


def test_chat_refuses_real_values_naming_the_feature(llm):
    with pytest.raises(NotImplementedError, match="lora_request.*LoRA adapters"):
        llm.chat(CHAT, GREEDY, use_tqdm=False, lora_request=object())
    with pytest.raises(NotImplementedError, match="mm_processor_kwargs.*text-only"):
        llm.chat(CHAT, GREEDY, use_tqdm=False, mm_processor_kwargs={"num_crops": 4})
    with pytest.raises(ValueError, match="chat_template_content_format='html'.*'auto', 'string'.*'openai'"):
        llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template_content_format="html")


@pytest.mark.parametrize("content_format, rendered", [
    ("auto", "S:a\nb;S:c;"), ("string", "S:a\nb;S:c;"), ("openai", "L:[a][b];L:[c];")])
def test_chat_template_content_format_is_honoured(llm, content_format, rendered):
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=SHOW_FORMAT, add_generation_prompt=False,
                   chat_template_content_format=content_format)
    assert out[0].prompt == rendered


@pytest.mark.parametrize("method", ["beam_search", "encode", "classify", "collective_rpc", "apply_model",
                                    "get_metrics"])
def test_missing_vllm_methods_name_what_to_use(llm, method):
    assert hasattr(llm, method)  # as on vLLM's LLM: code probing for it finds it, calling it says why not
    with pytest.raises(NotImplementedError, match=rf"LLM\.{method} \(vLLM's\) is not supported.*(use|LLM\.)"):
        getattr(llm, method)("anything", key=1)


def test_prompt_typeddicts_and_request_output_kind_are_exported(llm):
    from fxrewrite.runtime.engine.sampling_params import RequestOutputKind

    assert fxrewrite.RequestOutputKind is RequestOutputKind
    ids = llm.get_tokenizer().encode("Hello")
    tokens, text = fxrewrite.TokensPrompt(prompt_token_ids=ids), fxrewrite.TextPrompt(prompt="Hello")
    assert fxrewrite.TokensPrompt.__required_keys__ == {"prompt_token_ids"}
    by_ids, by_text = llm.generate([tokens, text], GREEDY, use_tqdm=False)
    assert list(by_ids.prompt_token_ids) == ids == list(by_text.prompt_token_ids)
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids


def test_vllms_engine_and_config_accessors(llm):
    """`llm.llm_engine.get_tokenizer()`, `get_model_config()`, `get_num_unfinished_requests()` and `llm.model_config`
    (vLLM's; they were AttributeErrors), on the data-parallel engine too."""
    from fxrewrite.runtime.engine.data_parallel import DPLLMEngine

    engine = llm.llm_engine
    assert engine.get_tokenizer() is llm.get_tokenizer()
    assert llm.model_config is engine.model_config is engine.get_model_config() and llm.model_config.max_model_len == 256
    assert engine.get_num_unfinished_requests() == 0
    engine.add_request("accessors", "Hello", GREEDY)
    assert engine.get_num_unfinished_requests() == 1
    engine.abort_request("accessors")
    assert engine.get_num_unfinished_requests() == 0
    assert all(hasattr(DPLLMEngine, name) for name in ("get_tokenizer", "get_model_config",
                                                         "get_num_unfinished_requests"))


def test_cache_salt_keeps_a_cached_prefix_to_prompts_of_the_same_salt(llm):
    """vLLM's cache_salt in a TextPrompt / TokensPrompt: a prompt cached under one salt is a prefix-cache hit only
    for the same salt (not for another, nor for none); the tokens do not change; a bad salt is refused, named."""
    ids = list(range(10, 90))  # several full blocks
    hits = []
    want = llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for salt in ("a", "b", None, "a"):
        before = llm.llm_engine.get_stats()["prefix_cache_hits"]
        prompt = fxrewrite.TokensPrompt(prompt_token_ids=ids, **({"cache_salt": salt} if salt else {}))
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
        hits.append(llm.llm_engine.get_stats()["prefix_cache_hits"] - before)
    assert hits[0] == hits[1] == 0 and hits[2] > 0 and hits[3] > 0, hits
    for bad in ("", 7):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            llm.generate([{"prompt": "Hi", "cache_salt": bad}], GREEDY, use_tqdm=False)
