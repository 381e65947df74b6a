"""Tool-call parsers on the formats the model families write (no model needed)."""

import json

import pytest

from fxrewrite.runtime.server.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    get_tool_parser,
    parser_for_template,
)
from fxrewrite.runtime.server.protocol import ChatCompletionRequest
from fxrewrite.runtime.server.tools import parse_output


def _calls(parsed):
    content, calls = parsed
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes():
    p = HermesToolParser()
    text = ('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
    # the text before the first call as written (vLLM does not strip it; the stream sent it so)
    assert _calls(p.parse(text)) == ("Let me check.\n", [("f", {"x": 1}), ("g", {})])
    assert _calls(p.parse("plain answer")) == ("plain answer", [])
    assert _calls(p.parse("<tool_call>{broken")) == ("<tool_call>{broken", [])  # stays content
    assert p.content_boundary("Hello <tool") == len("Hello ")
    assert p.content_boundary("Hello <tool_call>{") == len("Hello ")
    assert p.content_boundary("Hello world") == len("Hello world")


def test_llama3_json():
    p = Llama3JsonToolParser()
    assert _calls(p.parse('{"name": "f", "parameters": {"a": "b"}}')) == (None, [("f", {"a": "b"})])
    text = '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"k": 2}}'
    assert _calls(p.parse(text)) == (None, [("f", {}), ("g", {"k": 2})])
    assert _calls(p.parse("The answer is 4.")) == ("The answer is 4.", [])
    assert p.content_boundary('{"na') == 0 and p.content_boundary("The") == 3


def test_mistral():
    p = MistralToolParser()
    assert p.needs_special_tokens
    text = '[TOOL_CALLS][{"name": "f", "arguments": {"q": "x"}}, {"name": "g", "arguments": {}}]'
    assert _calls(p.parse(text)) == (None, [("f", {"q": "x"}), ("g", {})])
    assert _calls(p.parse("no calls")) == ("no calls", [])


def test_parser_picked_by_template():
    assert isinstance(parser_for_template("... <tool_call> ..."), HermesToolParser)
    assert isinstance(parser_for_template("{{ '[TOOL_CALLS]' }}"), MistralToolParser)
    assert isinstance(parser_for_template("<|python_tag|>"), Llama3JsonToolParser)
    assert parser_for_template("{{ messages }}") is None
    with pytest.raises(ValueError, match="writes no tool-call format"):
        get_tool_parser("auto", "{{ messages }}")
    with pytest.raises(ValueError, match="not one of"):
        get_tool_parser("nope", None)
    assert isinstance(get_tool_parser("mistral", None), MistralToolParser)


def test_arguments_keep_non_ascii_text_as_written():
    """Arguments are re-serialised with ensure_ascii=False, as vLLM's parsers do: "Zürich", not "Z\\u00fcrich"."""
    text = '<tool_call>\n{"name": "f", "arguments": {"city": "Zürich ☀"}}\n</tool_call>'
    assert HermesToolParser().parse(text)[1][0].arguments == '{"city": "Zürich ☀"}'
    mistral = MistralToolParser().parse('[TOOL_CALLS][{"name": "f", "arguments": {"q": "日本"}}]')
    assert mistral[1][0].arguments == '{"q": "日本"}'
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice="required",
                                    tools=[{"type": "function", "function": {"name": "f"}}])
    _, calls = parse_output(request, '[{"name": "f", "parameters": {"city": "Zürich"}}]', None)
    assert calls[0].function.arguments == '{"city": "Zürich"}'


DEEP = "[" * 100000  # json.loads raises RecursionError on nesting this deep


@pytest.mark.parametrize("parser, text", [
    (HermesToolParser(), "<tool_call>" + DEEP),
    (HermesToolParser(), '<tool_call>{"name": "f", "arguments": ' + DEEP + "]" * 100000 + "}</tool_call>"),
    (Llama3JsonToolParser(), '{"name": "f", "parameters": ' + DEEP),
    (MistralToolParser(), "[TOOL_CALLS]" + DEEP),
])
def test_output_nested_too_deeply_stays_content(parser, text):
    """A RecursionError from json was a 500; such text is content, as any other text that does not parse."""
    assert parser.parse(text) == (text, [])


def test_required_output_nested_too_deeply_stays_content():
    """A recursive schema lets a forced call nest until max_tokens; that text is content, as any cut-short output."""
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice="required",
                                    tools=[{"type": "function", "function": {"name": "f"}}])
    text = '[{"name": "f", "parameters": {"a": ' + DEEP
    assert parse_output(request, text, None) == (text, [])
    closed = text + "]" * 100000 + "}}]"  # complete, still too deep for json
    assert parse_output(request, closed, None) == (closed, [])


def test_lone_surrogate_in_arguments_is_written_as_its_escape():
    """json.loads keeps an unpaired "\\ud800" escape as a lone surrogate, which no UTF-8 response can carry (a 500,
    or an error event mid-stream); it goes out as its escape, other non-ASCII text as written."""
    escaped = '{"a": "\\ud800 Zürich", "\\udfff": ["☀ \\ud83d\\ude00"]}'  # the JSON text a model writes
    expected = '{"a": "\\ud800 Zürich", "\\udfff": ["☀ 😀"]}'
    hermes = HermesToolParser().parse(f'<tool_call>{{"name": "f", "arguments": {escaped}}}</tool_call>')
    llama = Llama3JsonToolParser().parse(f'{{"name": "f", "parameters": {escaped}}}')
    mistral = MistralToolParser().parse(f'[TOOL_CALLS][{{"name": "f", "arguments": {escaped}}}]')
    as_string = HermesToolParser().parse(  # the arguments written as a JSON string holding their JSON text
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": \\"\\ud800\\"}"}</tool_call>')
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice="required",
                                    tools=[{"type": "function", "function": {"name": "f"}}])
    _, required = parse_output(request, f'[{{"name": "f", "parameters": {escaped}}}]', None)
    arguments = [p[1][0].arguments for p in (hermes, llama, mistral)] + [required[0].function.arguments]
    assert arguments == [expected] * 4
    assert as_string[1][0].arguments == '{"a": "\\ud800"}'
    for text in arguments + [as_string[1][0].arguments]:
        text.encode("utf-8")  # no UnicodeEncodeError
    assert json.loads(expected) == json.loads(escaped)  # the same value as the model wrote
