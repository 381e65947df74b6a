"""Tool-call parsers: a model's text -> (content, tool calls), one parser per format (vLLM's names).

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2.5, Qwen3).
- `llama3_json`: Llama 3.1/3.2's JSON form, `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`, several separated by `;`), as the whole message.
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`.

`parser_for_template(chat_template)` picks one by the markers a chat template writes (the model
family). A parser never raises on model output: text that does not parse (or is nested too deeply for json)
stays content. While streaming, `content_boundary(text)` says how much text is surely content (before a tool-call
marker, or before a tail that may start one), so the chat stream can send content early and the calls at the end.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from fxrewrite.errors import UserInputError


@dataclass
class ParsedToolCall:
    name: str
    arguments: str
    """The arguments as JSON text."""


_UNPARSABLE = (ValueError, RecursionError)
"""What json raises on text that is not JSON (JSONDecodeError is a ValueError) or nested too deeply to parse."""

_SURROGATE = re.compile("[\ud800-\udfff]")


def dump_arguments(arguments) -> str:
    """Tool-call arguments as JSON text, non-ASCII characters as written ("Zürich", not "Z\\u00fcrich", as vLLM's
    parsers write them), except a lone UTF-16 surrogate (what an unpaired "\\ud800" escape decodes to): that one
    is written as its escape, since no response can encode it as UTF-8."""
    return _escape_surrogates(json.dumps(arguments, ensure_ascii=False))


def _escape_surrogates(text: str) -> str:
    # json writes a surrogate raw only inside a string, where its \uXXXX escape reads back as the same character
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _call(obj, arguments_key: str) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    # a string is the arguments' JSON text already (a model may write them so)
    arguments = _escape_surrogates(arguments) if isinstance(arguments, str) else dump_arguments(arguments)
    return ParsedToolCall(obj["name"], arguments)


class ToolParser:
    name = "base"
    start = ""
    """The marker that opens the tool-call part of a message."""
    needs_special_tokens = False
    """Whether the marker is a special token (then the text must be decoded with skip_special_tokens=False)."""

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content or None, tool calls); no calls means all the text is content."""
        raise NotImplementedError

    def content_boundary(self, text: str) -> int:
        """Length of the prefix of `text` that is content whatever comes next."""
        idx = text.find(self.start)
        if idx != -1:
            return idx
        for k in range(min(len(self.start) - 1, len(text)), 0, -1):  # a tail that may begin the marker
            if self.start.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class HermesToolParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text):
        if self.start not in text:
            return text, []
        calls = []
        for body in self._block.findall(text):
            try:
                call = _call(json.loads(body), "arguments")
            except _UNPARSABLE:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[: text.find(self.start)]  # unstripped, as vLLM (and as the stream sent it)
        return content or None, calls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start = "{"

    def parse(self, text):
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
                call = _call(obj, "parameters")
            except _UNPARSABLE:
                return text, []
            if call is None:
                return text, []
            calls.append(call)
            pos = len(body) - len(body[pos:].lstrip().removeprefix(";").lstrip())
        return None, calls

    def content_boundary(self, text):
        stripped = text.lstrip().removeprefix("<|python_tag|>").lstrip()
        if not stripped or stripped.startswith("{") or "<|python_tag|>".startswith(text.strip()):
            return 0  # may be a call: hold everything until the end
        return len(text)


class MistralToolParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"
    needs_special_tokens = True

    def parse(self, text):
        idx = text.find(self.start)
        if idx == -1:
            return text, []
        body = text[idx + len(self.start):].strip()
        try:
            objs, _ = json.JSONDecoder().raw_decode(body)
            calls = [_call(o, "arguments") for o in (objs if isinstance(objs, list) else [objs])]
        except _UNPARSABLE:
            return text, []
        if not calls or any(c is None for c in calls):
            return text, []
        return text[:idx] or None, calls


TOOL_PARSERS = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def parser_for_template(chat_template: str | None) -> ToolParser | None:
    """The parser of the format a chat template writes tool calls in, or None when none is recognised."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return HermesToolParser()
    if "[TOOL_CALLS]" in template:
        return MistralToolParser()
    if "<|python_tag|>" in template or ('"parameters"' in template and "ipython" in template):
        return Llama3JsonToolParser()
    return None


def get_tool_parser(name: str, chat_template: str | None) -> ToolParser:
    """`--tool-call-parser NAME` ("auto": by the chat template); ValueError naming the choices."""
    if name == "auto":
        parser = parser_for_template(chat_template)
        if parser is None:
            raise UserInputError("--tool-call-parser auto: the chat template writes no tool-call format this server "
                             f"knows; pass one of {sorted(TOOL_PARSERS)}")
        return parser
    if name not in TOOL_PARSERS:
        raise UserInputError(f"--tool-call-parser {name!r} is not one of {sorted(TOOL_PARSERS)} or 'auto'")
    return TOOL_PARSERS[name]()
