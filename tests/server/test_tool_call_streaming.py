"""Forced tool calls (tool_choice "required" / a named function) stream their arguments as they are generated:
the incremental parse of the "required" JSON list on hand-written prefixes, `ToolStream` on fake deltas, and
streamed vs non-streamed requests against the test server (tiny Qwen3, greedy)."""

import json
from types import SimpleNamespace

import pytest

from fxrewrite.runtime.server.partial_json import RequiredCallsParser, canonical_number
from fxrewrite.runtime.server.protocol import ChatCompletionRequest
from fxrewrite.runtime.server.streaming import ChoiceDelta
from fxrewrite.runtime.server.tool_parsers import HermesToolParser, dump_arguments
from fxrewrite.runtime.server.tool_stream import ToolStream

TEXTS = [
    # escaped quotes and backslashes, nested objects and lists, numbers json.dumps rewrites, literals
    r'[{"name":"f","parameters":{"q":"say \"hi\" \\ back\/slash","o":{"p":{"r":[1,2.50,-0,1E2,-3e-2]},'
    r'"s":[]},"t":true,"u":null,"v":false,"w":{}}}]',
    # unicode: raw, escaped (\u00fc), a surrogate pair, a lone high surrogate, control characters
    r'[{"name":"g","parameters":{"city":"Zürich ☀ 日本","e":"Z\u00fcrich \ud83d\ude00 \ud83d! \n\t\u0001"}}]',
    # two calls in the list, with free whitespace, the second with empty parameters
    '[ {"name": "f", "parameters": {"a": [ {"b": "c"} ], "d": 1}} ,\n {"name": "get_time", "parameters": {}} ]',
    # parameters before name; escaped characters in the name; a scalar as the parameters
    r'[{"parameters":{"k":"v"},"name":"h\u0041"},{"name":"f","parameters":"s"},{"name":"n","parameters":12}]',
]


def _expected(text):
    return [(o["name"], dump_arguments(o["parameters"])) for o in json.loads(text)]


@pytest.mark.parametrize("text", TEXTS)
def test_required_parser_writes_only_certain_text_on_every_prefix(text):
    """Fed one character at a time, each call's arguments only ever grow, always as a prefix of what the
    finished response carries (json.dumps of the parsed parameters); names appear only when whole."""
    expected = _expected(text)
    parser, before = RequiredCallsParser(), []
    for i, ch in enumerate(text):
        parser.feed(ch)
        assert not parser.bad, text[: i + 1]
        now = [(c.name, c.arguments) for c in parser.calls]
        for k, (name, arguments) in enumerate(now):
            assert name in (None, expected[k][0]) and expected[k][1].startswith(arguments), (text[: i + 1], now)
            if k < len(before):
                assert arguments.startswith(before[k][1]) and (before[k][0] is None or name == before[k][0])
        before = now
    assert before == expected


def test_required_parser_on_chosen_prefixes():
    """What is certain at a few cut points: a number waits for the character after it, an escape for its
    last character, a high surrogate for what follows it, a name for its closing quote."""
    def parse(text):
        parser = RequiredCallsParser()
        parser.feed(text)
        return [(c.name, c.arguments) for c in parser.calls]

    assert parse('[{"name":"get_ti') == [(None, "")]
    assert parse('[{"name":"get_time","parameters":{"tz":"U') == [("get_time", '{"tz": "U')]
    assert parse('[{"name":"f","parameters":{"n":12') == [("f", '{"n": ')]
    assert parse('[{"name":"f","parameters":{"n":12,') == [("f", '{"n": 12, ')]
    assert parse('[{"name":"f","parameters":{"n":1.0e') == [("f", '{"n": ')]
    assert parse('[{"name":"f","parameters":{"s":"a\\') == [("f", '{"s": "a')]
    assert parse('[{"name":"f","parameters":{"s":"a\\"') == [("f", '{"s": "a\\"')]
    assert parse('[{"name":"f","parameters":{"s":"a\\u00f') == [("f", '{"s": "a')]
    assert parse('[{"name":"f","parameters":{"s":"a\\u00fc') == [("f", '{"s": "aü')]
    assert parse('[{"name":"f","parameters":{"s":"\\ud83d') == [("f", '{"s": "')]
    assert parse('[{"name":"f","parameters":{"s":"\\ud83d\\ude00') == [("f", '{"s": "😀')]
    assert parse('[{"name":"f","parameters":{"b":tru') == [("f", '{"b": ')]
    assert parse('[{"name":"f","parameters":{}},{"name":"g","parameters":{"x":[') == [
        ("f", "{}"), ("g", '{"x": [')]
    assert canonical_number("-0") == "0" and canonical_number("1E400") == "Infinity"
    assert canonical_number("01") is None


@pytest.mark.parametrize("text", ['{"name":"f"}', '[{"name":"f","parameters":{"a":1}}] x', '[{"name":"f",,'])
def test_required_parser_stops_at_text_that_is_not_the_list(text):
    parser = RequiredCallsParser()
    parser.feed(text)
    assert parser.bad


TOOLS = [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]


def _fake_deltas(text, step, finish_reason="stop"):
    """The ChoiceDeltas of one choice generating `text` `step` characters at a time."""
    for start in range(0, len(text), step):
        end = min(len(text), start + step)
        finished = end == len(text)
        choice = SimpleNamespace(index=0, text=text[:end], finish_reason=finish_reason if finished else None)
        yield ChoiceDelta(0, choice, text[start:end], start, 0, 0, start == 0, finished)


def _collect(stream, text, step, finish_reason="stop"):
    calls, content, finish = {}, "", None
    for d in _fake_deltas(text, step, finish_reason):
        for message in stream.deltas(d):
            content += message.content or ""
            for call in message.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "pieces": []})
                assert (call.id is not None) == (len(entry["pieces"]) == 0)  # id with the first delta only
                entry["pieces"].append(call.function.arguments)
        if d.finished:
            finish = stream.finish_reason(d.choice)
    return calls, content, finish


@pytest.mark.parametrize("step", [1, 3, 7])
def test_tool_stream_sends_required_arguments_in_pieces(step):
    text = TEXTS[2]
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice="required", tools=TOOLS)
    calls, content, finish = _collect(ToolStream(request, None), text, step)
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], "".join(c["pieces"])) for c in calls.values()] == _expected(text)
    assert all(c["id"].startswith("call") for c in calls.values()) and len(calls[0]["pieces"]) > 1


@pytest.mark.parametrize("choice, text, value", [
    ("required", r'[{"name":"f","parameters":{"\udfff":"\ud800 Zürich","b":"x\uDBFF"}}]',
     {"\udfff": "\ud800 Zürich", "b": "x\udbff"}),
    ("auto", r'<tool_call>{"name": "f", "arguments": {"a": "\ud800 Zürich"}}</tool_call>', {"a": "\ud800 Zürich"}),
])
def test_tool_stream_sends_lone_surrogates_as_escapes(choice, text, value):
    """An unpaired "\\ud800" escape decodes to a lone surrogate, which an event's JSON cannot carry (the stream
    ended in an error event); its escape goes out instead, non-ASCII text as written."""
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice=choice, tools=TOOLS)
    stream, messages = ToolStream(request, HermesToolParser()), []
    for d in _fake_deltas(text, 1):
        messages += stream.deltas(d)
    arguments = "".join(c.function.arguments for m in messages for c in m.tool_calls or [])
    assert all(m.model_dump_json() for m in messages)  # was PydanticSerializationError (surrogates not allowed)
    assert "Zürich" in arguments and "\\ud800" in arguments and json.loads(arguments) == value


def test_tool_stream_required_cut_short_ends_with_the_text_as_content():
    """As the non-streamed response: a list cut short by max_tokens is no call; its text comes as content."""
    text = '[{"name":"f","parameters":{"a":"abcdef'
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice="required", tools=TOOLS)
    calls, content, finish = _collect(ToolStream(request, None), text, 4, finish_reason="length")
    assert content == text and finish == "length" and calls[0]["name"] == "f"


# Against the test server: a tool whose arguments take many tokens, greedy, streamed and not.
NOTE = {"type": "function", "function": {"name": "write_note", "parameters": {
    "type": "object", "properties": {
        "title": {"type": "string", "minLength": 12, "maxLength": 24},
        "meta": {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b\"c"]},
                                                           "minItems": 1, "maxItems": 3},
                                                  "n": {"type": "integer"}},
                 "required": ["tags", "n"], "additionalProperties": False}},
    "required": ["title", "meta"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "write_note"}}


@pytest.fixture(scope="module")
def live(server, grammar_compiler):
    return server


def _request(server, **kwargs):
    client = server.client().with_options(timeout=600)
    return client.chat.completions.create(model=server.model_name, temperature=0.0, max_tokens=200,
                                          messages=[{"role": "user", "content": "Take a note."}], **kwargs)


def _streamed_calls(server, **kwargs):
    """{index: (id, name, [argument pieces])} of a streamed request, and its finish_reason."""
    calls, finish = {}, None
    for chunk in _request(server, stream=True, **kwargs):
        for choice in chunk.choices:
            assert not choice.delta.content
            for call in choice.delta.tool_calls or []:
                if call.index not in calls:  # the first delta of a call: id, type and name
                    assert call.id and call.type == "function" and call.function.name, call
                    calls[call.index] = (call.id, call.function.name, [])
                else:
                    assert call.id is None and call.function.name is None
                calls[call.index][2].append(call.function.arguments or "")
            finish = choice.finish_reason or finish
    return calls, finish


@pytest.mark.slow
@pytest.mark.parametrize("tools, tool_choice, parallel, finish", [
    ([NOTE], "required", False, "tool_calls"),  # one call of many tokens
    ([TIME], "required", True, "tool_calls"),  # greedy, the tiny model lists more than one call
    ([NOTE, TIME], NAMED, None, "stop"),
])
def test_forced_tool_call_streams_arguments_as_generated(live, tools, tool_choice, parallel, finish):
    """The streamed calls (first delta: id, type, name; then argument pieces under the same index) join to the
    non-streamed request's calls; long arguments come in many pieces. finish_reason as without streaming."""
    kwargs = {"tools": tools, "tool_choice": tool_choice}
    if parallel is not None:
        kwargs["parallel_tool_calls"] = parallel
    whole = _request(live, **kwargs).choices[0]
    assert whole.finish_reason == finish and whole.message.content is None and whole.message.tool_calls, whole
    calls, streamed_finish = _streamed_calls(live, **kwargs)
    assert streamed_finish == finish and sorted(calls) == list(range(len(calls)))
    assert [(name, "".join(pieces)) for _, name, pieces in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert len({call_id for call_id, _, _ in calls.values()}) == len(calls)
    for _, name, pieces in calls.values():
        assert sum(1 for piece in pieces if piece) > (8 if name == "write_note" else 3), pieces


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "tag"}}])
def test_a_forced_call_names_the_unenforced_keyword_in_the_tools_own_parameters(tool_choice):
    """A keyword the grammar would not enforce in a tool's parameters: the 400 names tools[i].function.parameters and
    the place inside them (it named the wrapped schema's /items/anyOf/0/properties/parameters/..., a fresh user's)."""
    from fxrewrite.runtime.server.errors import OpenAIError
    from fxrewrite.runtime.server.tools import forced_tool_outputs

    tools = [TOOLS[0], {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}]
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice=tool_choice, tools=tools)
    with pytest.raises(OpenAIError, match=r"tools\[1\].function.parameters \('tag'\): 'uniqueItems' at "
                                          r"/properties/a is not enforced") as raised:
        forced_tool_outputs(request)
    assert raised.value.status == 400 and raised.value.param == "tools"
