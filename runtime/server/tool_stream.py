"""Streamed tool calls: the chat stream's deltas under `tool_choice`, shaped as OpenAI sends them.

Forced calls stream their arguments as they are generated, as vLLM does: the first delta of a call carries its
index, id, type "function", name and the arguments known so far (possibly ""); later ones only more arguments,
under the same index, so that a call's argument pieces join to the finished response's arguments. A named
function's arguments are the generated text itself. Under "required" the text is a JSON list of calls, parsed
as it comes (`partial_json.RequiredCallsParser`); when the choice finishes, the parsed list decides what is
left to send. For "auto", content streams up to the parser's boundary (text before a tool-call marker, or
before a tail that may start one); the calls themselves go out when the choice finishes, each as one delta with
id, type, name and the whole arguments. A "required" choice cut short (max_tokens) has no calls: its text goes
out as content at the end, after whatever argument pieces were already sent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fxrewrite.runtime.server.partial_json import RequiredCallsParser
from fxrewrite.runtime.server.protocol import ChatCompletionRequest, random_id
from fxrewrite.runtime.server.protocol_responses import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from fxrewrite.runtime.server.streaming import ChoiceDelta
from fxrewrite.runtime.server.tool_parsers import ToolParser
from fxrewrite.runtime.server.tools import finish_reason, parse_output, tool_mode

logger = logging.getLogger(__name__)


@dataclass
class _RequiredChoice:
    """One choice's "required" stream: its parser, how much text it was fed, and per call (by index) the id
    sent with its first delta and how many of its argument pieces went out."""

    parser: RequiredCallsParser = field(default_factory=RequiredCallsParser)
    fed: int = 0
    ids: list[str] = field(default_factory=list)
    sent_parts: list[int] = field(default_factory=list)


def _call_delta(index: int, arguments: str, call_id: str | None = None, name: str | None = None) -> DeltaMessage:
    """A tool-call delta: the first of a call (id, type, name and arguments) or a later one (arguments only)."""
    fn = DeltaFunctionCall(name=name, arguments=arguments)
    typ = "function" if call_id is not None else None
    return DeltaMessage(tool_calls=[DeltaToolCall(index=index, id=call_id, type=typ, function=fn)])


class ToolStream:
    """Per-request state: how much content each choice has sent, whether its calls went out."""

    def __init__(self, request: ChatCompletionRequest, parser: ToolParser | None):
        self.request = request
        self.mode = tool_mode(request)
        if self.mode == "auto" and parser is None:
            self.mode = "none"
        self.parser = parser
        self._sent: dict[int, int] = {}
        self._called: dict[int, bool] = {}
        self._id: dict[int, str] = {}
        self._required: dict[int, _RequiredChoice] = {}

    def deltas(self, d: ChoiceDelta) -> list[DeltaMessage]:
        """The delta messages for one choice delta (empty when nothing is to be sent yet)."""
        if self.mode == "none":
            return [DeltaMessage(content=d.text)] if d.text else []
        if self.mode == "named":
            return self._named(d)
        if self.mode == "required":
            return self._required_deltas(d)
        visible = d.choice.text[: d.text_start + len(d.text)]
        index = d.choice.index
        sent = self._sent.get(index, 0)
        if not d.finished:
            boundary = self.parser.content_boundary(visible) if self.mode == "auto" else 0
            if boundary <= sent:
                return []
            self._sent[index] = boundary
            return [DeltaMessage(content=visible[sent:boundary])]
        content, calls = parse_output(self.request, visible, self.parser)
        self._called[index] = bool(calls)
        out = []
        rest = visible[sent:] if not calls else (content or "")[sent:]
        if rest:
            out.append(DeltaMessage(content=rest))
        for i, call in enumerate(calls):
            fn = DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments)
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=i, id=call.id, type="function", function=fn)]))
        return out

    def _named(self, d: ChoiceDelta) -> list[DeltaMessage]:
        index = d.choice.index
        if not d.text:
            return []
        if index not in self._id:
            self._id[index] = random_id("call")
            fn = DeltaFunctionCall(name=self.request.tool_choice.function.name, arguments=d.text)
            call = DeltaToolCall(index=0, id=self._id[index], type="function", function=fn)
        else:
            call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=d.text))
        return [DeltaMessage(tool_calls=[call])]

    def _required_deltas(self, d: ChoiceDelta) -> list[DeltaMessage]:
        """Each call's first delta once its name is known, then its new argument pieces; at the end, what the
        parsed list has beyond what was sent (or the text as content when it does not parse)."""
        state = self._required.setdefault(d.choice.index, _RequiredChoice())
        visible = d.choice.text[: d.text_start + len(d.text)]
        if d.finished:
            return self._required_end(d.choice.index, state, visible)
        state.parser.feed(visible[state.fed:])
        state.fed = len(visible)
        out = []
        for i, call in enumerate(state.parser.calls):
            if call.name is None:  # calls are sent in order: none before this one's name is known
                break
            if i == len(state.ids):
                state.ids.append(random_id("call"))
                state.sent_parts.append(len(call.parts))
                out.append(_call_delta(i, "".join(call.parts), state.ids[i], call.name))
            elif len(call.parts) > state.sent_parts[i]:
                out.append(_call_delta(i, "".join(call.parts[state.sent_parts[i]:])))
                state.sent_parts[i] = len(call.parts)
        return out

    def _required_end(self, index: int, state: _RequiredChoice, visible: str) -> list[DeltaMessage]:
        content, calls = parse_output(self.request, visible, self.parser)
        self._called[index] = bool(calls)
        if not calls:
            return [DeltaMessage(content=content)] if content else []
        out = []
        for i, call in enumerate(calls):
            arguments = call.function.arguments
            if i >= len(state.ids):
                out.append(_call_delta(i, arguments, call.id, call.function.name))
                continue
            sent = "".join(state.parser.calls[i].parts[: state.sent_parts[i]])
            if not arguments.startswith(sent):  # a repeated key: json.loads kept its last value
                logger.warning("tool call %d's streamed arguments %r differ from the parsed %r", i, sent, arguments)
            elif len(arguments) > len(sent):
                out.append(_call_delta(i, arguments[len(sent):]))
        return out

    def finish_reason(self, choice) -> str | None:
        calls = [True] if self._called.get(choice.index) else []
        return finish_reason(self.request, choice.finish_reason, calls)
