"""Streamed tool calls: the chat stream's deltas under `tool_choice`, shaped as OpenAI sends them.

A named function's arguments stream as they are generated: the first delta carries the call's index,
id, type and name with the first piece of the arguments, later ones only more arguments. For "auto",
content streams up to the parser's boundary (text before a tool-call marker, or before a tail that may
start one); the calls themselves go out when the choice finishes, each as one delta with id, type, name
and the whole arguments. "required" sends the calls at the end too (the output is a JSON list until then).
"""

from __future__ import annotations

from fxrewrite.runtime.server.protocol import ChatCompletionRequest, random_id
from fxrewrite.runtime.server.protocol_responses import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from fxrewrite.runtime.server.streaming import ChoiceDelta
from fxrewrite.runtime.server.tool_parsers import ToolParser
from fxrewrite.runtime.server.tools import finish_reason, parse_output, tool_mode


class ToolStream:
    """Per-request state: how much content each choice has sent, whether its calls went out."""

    def __init__(self, request: ChatCompletionRequest, parser: ToolParser | None):
        self.request = request
        self.mode = tool_mode(request) if request.tools else "none"
        if self.mode == "auto" and parser is None:
            self.mode = "none"
        self.parser = parser
        self._sent: dict[int, int] = {}
        self._called: dict[int, bool] = {}
        self._id: dict[int, str] = {}

    def deltas(self, d: ChoiceDelta) -> list[DeltaMessage]:
        """The delta messages for one choice delta (empty when nothing is to be sent yet)."""
        if self.mode == "none":
            return [DeltaMessage(content=d.text)] if d.text else []
        if self.mode == "named":
            return self._named(d)
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

    def finish_reason(self, choice) -> str | None:
        calls = [True] if self._called.get(choice.index) else []
        return finish_reason(self.request, choice.finish_reason, calls)
