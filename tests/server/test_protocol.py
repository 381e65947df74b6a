"""Request models: OpenAI field shapes, ranges and the cross-field rules the server relies on."""

import pytest
from pydantic import ValidationError

from fxrewrite.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from fxrewrite.runtime.server.streaming import DeltaTracker


@pytest.mark.parametrize(
    "prompt, expected",
    [("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_prompt_forms(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompts() == expected


def test_completion_defaults_are_openai_and_sampling_fields_unset():
    r = CompletionRequest(prompt="x")
    assert (r.max_tokens, r.n, r.stream, r.echo, r.logprobs) == (16, 1, False, False, None)
    assert r.temperature is None and r.top_p is None and r.top_k is None


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": -0.1}, {"temperature": float("inf")}, {"top_p": 0}, {"n": 0}, {"max_tokens": 0},
        {"presence_penalty": 3}, {"frequency_penalty": -2.1}, {"logprobs": -2}, {"top_k": -2},
        {"min_p": 1.5}, {"repetition_penalty": 0}, {"repetition_penalty": float("inf")}, {"min_tokens": -1},
        {"prompt": ""}, {"prompt": []},
        {"stream_options": {"include_usage": True}}, {"min_tokens": 20, "max_tokens": 10}, {"stop": [""]},
        {"prompt": ["a", ""]}, {"max_tokens": 2.5}, {"n": "2"}, {"n": True}, {"prompt": [1.5]},
    ],
)
def test_completion_rejects(fields):
    with pytest.raises(ValidationError):
        CompletionRequest(**({"prompt": "x"} | fields))


def test_whole_number_floats_are_integers_and_temperature_has_no_upper_bound():
    """vLLM's lax pydantic models take 2.0 for an integer field (as 2) and any temperature >= 0."""
    r = CompletionRequest(prompt=[1.0, 2.0], max_tokens=2.0, n=1.0, seed=3.0, top_k=5.0, min_tokens=1.0,
                          best_of=2.0, logprobs=1.0, prompt_logprobs=0.0, stop_token_ids=[7.0], temperature=3)
    values = (r.prompts(), r.max_tokens, r.n, r.seed, r.top_k, r.min_tokens, r.best_of, r.logprobs,
              r.prompt_logprobs, r.stop_token_ids)
    assert values == ([[1, 2]], 2, 1, 3, 5, 1, 2, 1, 0, [7])
    assert all(type(v) is int for v in values[1:-1]) and r.temperature == 3.0
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_completion_tokens=4.0,
                                 logprobs=True, top_logprobs=2.0, temperature=100.0)
    assert (chat.max_completion_tokens, chat.top_logprobs, chat.temperature) == (4, 2, 100.0)
    assert type(chat.max_completion_tokens) is int and type(chat.top_logprobs) is int


def test_chat_request():
    r = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]}],
                              max_completion_tokens=5, logprobs=True, top_logprobs=2)
    assert r.output_limit() == 5 and r.max_tokens is None
    assert r.messages[0].to_template_dict() == {"role": "user", "content": "a\nb"}
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[])
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    image = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ValueError, match="image_url"):
        image.messages[0].to_template_dict()


def test_a_refused_image_part_is_not_logged_as_ignored(caplog):
    """fresh-user report: an image_url part was refused with a 400 and also logged as 'fields ignored'."""
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with caplog.at_level("WARNING"):
        image = ChatCompletionRequest(messages=[{"role": "user", "content": [part]}], max_tokenz=3)
    with pytest.raises(ValueError, match="only text content parts .* got type 'image_url'"):
        image.messages[0].to_template_dict()
    warnings = [r.getMessage() for r in caplog.records]
    assert not any("ContentPart" in w for w in warnings), warnings
    assert any("['max_tokenz']" in w for w in warnings), warnings  # a misspelt request field still is


def test_include_usage_needs_stream():
    r = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=True,
                              stream_options={"include_usage": True})
    assert r.include_usage()


def test_delta_tracker_holds_back_stop_prefixes():
    from fxrewrite.runtime.server.async_engine import ChoiceSnapshot, StepOutput

    def out(text, finish=None):
        choice = ChoiceSnapshot(0, text, tuple(range(len(text))), None, finish, None)
        return StepOutput("r", 3, (choice,), finish is not None)

    tracker = DeltaTracker(2)
    texts = [d.text for o in (out("abcE"), out("abcEN"), out("abcdefg"), out("abcdefg", "stop"))
             for d in tracker.deltas(0, o)]
    assert "".join(texts) == "abcdefg"
    assert texts[0] == "ab"  # "cE" could start "END": held back


@pytest.mark.parametrize(
    "fields",
    [{"functions": [{"name": "f"}]}, {"suffix": "x"}, {"use_beam_search": True}, {"priority": 5},
     {"tools": [{"type": "function"}]},
     {"response_format": {"type": "json_schema"}}, {"best_of": 1, "n": 2}, {"logit_bias": {"a": 5}},
     {"logit_bias": {"1": 500}}, {"seed": 2**64}, {"tool_choice": "required"},
     {"tools": [{"function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}],
)
def test_unsupported_or_invalid_fields_are_refused_not_ignored(fields):
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)


def test_a_priority_is_refused_naming_it():
    """vLLM answers a non-zero priority without its priority scheduling with a 400; it was silently ignored here."""
    with pytest.raises(ValidationError, match=r"priority=5 is not supported by this server \(only 0 is accepted\)"):
        CompletionRequest(prompt="x", priority=5)


def test_tools_with_one_function_name_twice_are_refused_naming_it():
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with pytest.raises(ValidationError, match="'get_weather' more than once; expected unique function names"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[tool, tool], tool_choice="required")


def test_off_values_of_unsupported_fields_and_unknown_extras_pass():
    r = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logit_bias={}, best_of=1,
                              use_beam_search=False, priority=0, response_format={"type": "text"}, some_client_extra=1)
    assert r.model_extra["some_client_extra"] == 1


def test_unknown_fields_are_ignored_but_logged(caplog):
    with caplog.at_level("WARNING", logger="fxrewrite.runtime.server.protocol"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_token=5)
    assert "['max_token'] are not supported and were ignored" in caplog.text


def test_null_takes_the_default_where_the_field_has_no_null_meaning():
    r = CompletionRequest(prompt="x", n=None, stream=None, echo=None, max_tokens=None)
    assert (r.n, r.stream, r.echo, r.max_tokens) == (1, False, False, None)  # max_tokens: null is its own value
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=None, n=None)
    assert chat.logprobs is False and chat.n == 1
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=None)  # a required field stays required


@pytest.mark.parametrize("content, error", [
    ([], r"messages\[0\].content is an empty list"),
    ([{"type": "text"}], r"messages\[0\].content\[0\].text must be a string, got None"),
    ([{"type": "text", "text": None}], r"messages\[0\].content\[0\].text must be a string"),
    ([{"type": "text", "text": "a"}, {"type": "input_audio"}], r"messages\[0\].content\[1\]: only text .* 'input_audio'"),
])
def test_content_parts_that_are_not_text_are_refused_naming_the_part(content, error):
    request = ChatCompletionRequest(messages=[{"role": "user", "content": content}])
    with pytest.raises(ValueError, match=error):
        request.messages[0].to_template_dict("messages[0]")


def test_refusal_and_responses_text_parts_are_text_as_in_vllm(caplog):
    """fresh-user report: an assistant turn replayed from OpenAI's API with a refusal part, and the Responses
    API's input_text / output_text parts, were a 400; vLLM's chat parsing reads all three as text."""
    content = [{"type": "refusal", "refusal": "I can't."}, {"type": "input_text", "text": "a"},
               {"type": "output_text", "text": "b"}, {"type": "text", "text": "c"}]
    with caplog.at_level("WARNING", logger="fxrewrite.runtime.server.protocol"):
        request = ChatCompletionRequest(messages=[{"role": "assistant", "content": content}])
    assert request.messages[0].to_template_dict()["content"] == "I can't.\na\nb\nc"
    assert "ignored" not in caplog.text
    bad = ChatCompletionRequest(messages=[{"role": "assistant", "content": [{"type": "refusal", "text": "x"}]}])
    with pytest.raises(ValueError, match=r"content\[0\].refusal must be a string, got None"):
        bad.messages[0].to_template_dict("messages[0]")


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_an_assistant_turns_reasoning_reaches_the_template_under_both_names(field, caplog):
    """fresh-user report: a reply's reasoning sent back (Qwen3's template reads message.reasoning_content) was
    logged as 'not supported and were ignored'; vLLM gives the template both names."""
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "A", field: "R"}]
    with caplog.at_level("WARNING", logger="fxrewrite.runtime.server.protocol"):
        request = ChatCompletionRequest(messages=messages)
    assert "ignored" not in caplog.text
    assistant = request.messages[1].to_template_dict()
    assert assistant["reasoning"] == assistant["reasoning_content"] == "R"
    assert "reasoning" not in request.messages[0].to_template_dict()
