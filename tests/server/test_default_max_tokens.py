"""A request without max_tokens when the KV cache holds less than max_model_len (a CPU's default cache in
float32, a long --max-model-len): the server's default fills the cache, not the context, so the engine
takes it instead of answering 400 (`OpenAIServing.max_tokens_for`, `LLMEngine.max_seq_len`)."""

from __future__ import annotations

import pytest

from fxrewrite.runtime.server.errors import OpenAIError
from fxrewrite.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from fxrewrite.runtime.server.serving_engine import OpenAIServing

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _serving(max_model_len: int, max_seq_len: int, defaults=None) -> OpenAIServing:
    serving = object.__new__(OpenAIServing)  # only the limits matter here
    serving.max_model_len, serving.max_seq_len, serving.generation_defaults = max_model_len, max_seq_len, defaults or {}
    return serving


def test_default_max_tokens_fills_the_kv_cache_when_it_is_shorter_than_the_context():
    short = _serving(8192, 5825)  # 5824 KV slots: one more token fits (the last sampled one needs none)
    assert short.max_tokens_for(ChatCompletionRequest(**CHAT), 37, explicit=False) == 5825 - 37
    assert _serving(8192, 8192).max_tokens_for(ChatCompletionRequest(**CHAT), 37, explicit=False) == 8192 - 37
    assert short.max_tokens_for(CompletionRequest(prompt="hi"), 37, explicit=False) == 16  # OpenAI's default
    defaults = _serving(8192, 100, {"max_tokens": 512})  # generation_config's max_new_tokens: capped too
    assert defaults.max_tokens_for(ChatCompletionRequest(**CHAT), 37, explicit=False) == 100 - 37
    # max_new_tokens caps every request, as vLLM's get_max_tokens (the least of them): a completion's 16, a chat
    # request's own max_tokens too (a fresh user found 16 / 6 where the file said 4)
    four = _serving(8192, 8192, {"max_tokens": 4})
    assert four.max_tokens_for(CompletionRequest(prompt="hi"), 3, explicit=False) == 4
    assert four.max_tokens_for(ChatCompletionRequest(**CHAT, max_tokens=6), 3, explicit=True) == 4
    assert four.max_tokens_for(ChatCompletionRequest(**CHAT, max_tokens=2), 3, explicit=True) == 2
    assert four.max_tokens_for(ChatCompletionRequest(**CHAT), 3, explicit=False) == 4
    assert short.max_tokens_for(ChatCompletionRequest(**CHAT), 5824, explicit=False) == 1  # the last slot
    for request, param in ((ChatCompletionRequest(**CHAT), "messages"), (CompletionRequest(prompt="hi"), "prompt")):
        with pytest.raises(OpenAIError, match=r"prompt has 5825 tokens, more than the KV cache holds \(5824\)") as e:
            short.max_tokens_for(request, 5825, explicit=False)  # no max_tokens the client never sent in it
        assert e.value.param == param and e.value.code == "context_length_exceeded"


def test_an_explicit_max_tokens_is_checked_against_the_context_and_the_kv_cache():
    short = _serving(8192, 5825)
    assert short.max_tokens_for(ChatCompletionRequest(**CHAT, max_tokens=5788), 37, explicit=True) == 5788  # fills it
    # past the cache: a 400 context_length_exceeded naming the field that set the limit, or the prompt alone
    with pytest.raises(OpenAIError, match=r"KV cache holds 5824 tokens, so a request may total 5825 \(the last "
                                          r"generated token is not cached\). However, you requested 6037 tokens") as e:
        short.max_tokens_for(ChatCompletionRequest(**CHAT, max_tokens=6000), 37, explicit=True)
    assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
    with pytest.raises(OpenAIError, match="Please reduce max_completion_tokens or the length") as e:
        short.max_tokens_for(ChatCompletionRequest(**CHAT, max_tokens=5, max_completion_tokens=6000), 37, explicit=True)
    assert e.value.param == "max_completion_tokens"
    for request in (CompletionRequest(prompt="hi", max_tokens=5), CompletionRequest(prompt="hi", max_tokens=0, echo=True)):
        with pytest.raises(OpenAIError, match=r"prompt has 5825 tokens, more than the KV cache holds \(5824\)") as e:
            short.max_tokens_for(request, 5825, explicit=True)
        assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    # an echo of the prompt alone generates one token (dropped): checked as 1, the cache's last slot included
    assert short.max_tokens_for(CompletionRequest(prompt="hi", max_tokens=0, echo=True), 5824, explicit=True) == 1
    with pytest.raises(OpenAIError, match="maximum context length is 8192"):
        short.max_tokens_for(ChatCompletionRequest(**CHAT, max_tokens=9000), 37, explicit=True)


def test_a_prompt_filling_the_context_says_the_completion_has_no_room():
    """truncate_prompt_tokens=-1 keeps max_model_len tokens, which leave none to generate: the 400 says so and names
    the truncation that fits (before: "maximum context length is 8192 ... your prompt has 8192 tokens")."""
    serving = _serving(8192, 9000)
    request = CompletionRequest(prompt="hi", max_tokens=1, truncate_prompt_tokens=-1)
    with pytest.raises(OpenAIError, match=r"your prompt has 8192 tokens, which leaves no room for the completion "
                                          r"\(at least 1 token\)\. Please reduce the length of the prompt "
                                          r"\(truncate_prompt_tokens=8191 keeps room for one token\)") as e:
        serving.max_tokens_for(request, 8192, explicit=True)
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"


def test_min_tokens_beyond_what_the_request_may_generate_is_a_400():
    """vLLM refuses min_tokens > max_tokens also when max_tokens was defaulted (to what the cache holds here)."""
    short = _serving(8192, 100)
    request = ChatCompletionRequest(**CHAT, min_tokens=80)
    max_tokens = short.max_tokens_for(request, 37, explicit=False)
    with pytest.raises(OpenAIError, match=r"min_tokens \(80\) is more than the 63 tokens this request may generate") as e:
        short.sampling_params(request, max_tokens, None)
    assert e.value.param == "min_tokens" and e.value.status == 400
