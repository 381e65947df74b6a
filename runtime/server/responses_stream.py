"""The Responses API's server-sent events (`stream: true` on POST /v1/responses), as the openai client parses them.

Each event is ``event: <type>`` plus ``data: {"type": <type>, "sequence_number": n, ...}`` (n counts from 0), and
the stream ends after response.completed (no ``[DONE]``, as OpenAI's and vLLM's). The order:

    response.created, response.in_progress                 (the response object, status "in_progress")
    per output item, in order:
      response.output_item.added                           (the item, status "in_progress")
      reasoning: response.content_part.added (reasoning_text), response.reasoning_text.delta ...,
                 response.reasoning_text.done, response.content_part.done
      message:   response.content_part.added (output_text), response.output_text.delta ...,
                 response.output_text.done, response.content_part.done
      function_call: response.function_call_arguments.delta ..., response.function_call_arguments.done
      response.output_item.done                            (the finished item)
    response.completed                                     (the response object as without streaming; status
                                                            "incomplete" when max_output_tokens cut it, as vLLM)

The text goes through the chat stream's own machinery (`DeltaTracker`, `ReasoningStream`, `ToolStream`), so it
splits as a streamed chat reply does: forced calls (tool_choice required / named) stream their arguments as they are
generated; under "auto" the content streams up to a possible tool-call marker and each call comes whole when the
output ends (one arguments delta). An error mid-stream is one ``data: {"error": {...}}`` event (the openai client
raises APIError on it), as on chat.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fxrewrite.runtime.server.async_engine import StepOutput
from fxrewrite.runtime.server.logprobs import chat_logprobs
from fxrewrite.runtime.server.protocol import ChatCompletionRequest
from fxrewrite.runtime.server.protocol_responses import DeltaMessage
from fxrewrite.runtime.server.reasoning import ReasoningStream, parser_for_request
from fxrewrite.runtime.server.responses_protocol import (OutputFunctionCall, OutputItem, OutputMessage,
                                                         OutputReasoning, OutputText, ReasoningText)
from fxrewrite.runtime.server.serving_chat import ChatRun, OpenAIServingChat
from fxrewrite.runtime.server.streaming import DeltaTracker, sse_error
from fxrewrite.runtime.server.tool_stream import ToolStream


@dataclass
class ResponseRun:
    """What the event stream needs of the handler: the chat handler (its parsers), the chat request and run that
    serve the Responses request, and `response(output items, final StepOutput | None)` -> the response object."""

    chat: OpenAIServingChat
    chat_request: ChatCompletionRequest
    run: ChatRun
    response: Callable[[list[OutputItem], StepOutput | None], Any]


class ResponseEventWriter:
    """The events of one response's output items; `items` holds them as built (the last one open while it grows)."""

    def __init__(self, forced: bool = False, logprobs: bool = False):
        self.sequence_number = 0
        self.logprobs = logprobs  # the message's output_text carries them (include message.output_text.logprobs)
        self.pending: list[dict[str, Any]] = []  # token logprobs not yet sent (they go out with the message's text)
        self._item_logprobs: list[dict[str, Any]] = []
        self.forced = forced  # tool_choice forces the calls: a length cut leaves them "incomplete"
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self._text = ""  # the open item's text (message, reasoning) or arguments (function_call) so far

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open.id, "output_index": len(self.items) - 1}

    def _start(self, item: OutputItem) -> list[str]:
        # text after a forced call: its list did not parse (a length cut), the text follows as content
        after_call = isinstance(self._open, OutputFunctionCall) and isinstance(item, OutputMessage)
        out = self.close("incomplete" if after_call else "completed")
        item.status = "in_progress"
        self.items.append(item)
        self._open = item
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                              item=item.model_dump()))
        part = {"type": "output_text", "text": "", "annotations": []} if isinstance(item, OutputMessage) else (
            {"type": "reasoning_text", "text": ""} if isinstance(item, OutputReasoning) else None)
        if part is not None:
            out.append(self.event("response.content_part.added", content_index=0, part=part, **self._where()))
        return out

    def reasoning(self, piece: str) -> list[str]:
        out = [] if isinstance(self._open, OutputReasoning) else self._start(OutputReasoning())
        self._text += piece
        return out + [self.event("response.reasoning_text.delta", content_index=0, delta=piece, **self._where())]

    def delta(self, delta: DeltaMessage) -> list[str]:
        """The events of one chat stream delta (content and / or tool-call pieces)."""
        out = []
        if delta.content:
            if not isinstance(self._open, OutputMessage):
                out += self._start(OutputMessage(content=[]))
            self._text += delta.content
            sent, self.pending = self.pending, []
            self._item_logprobs += sent
            out.append(self.event("response.output_text.delta", content_index=0, delta=delta.content,
                                  logprobs=sent, **self._where()))
        for call in delta.tool_calls or ():
            arguments = call.function.arguments if call.function is not None else None
            if call.id is not None:  # a call's first delta: its id and name
                out += self._start(OutputFunctionCall(call_id=call.id, name=call.function.name, arguments=""))
            if arguments:
                self._text += arguments
                out.append(self.event("response.function_call_arguments.delta", delta=arguments, **self._where()))
        return out

    def close(self, status: str) -> list[str]:
        """The done events of the open item (none when none is open), which ends with `status`."""
        item, text = self._open, self._text
        if item is None:
            return []
        where, out = self._where(), []
        self._open, self._text = None, ""
        if isinstance(item, OutputMessage):
            if self.pending:  # tokens that made no text (a character cut short): chat sends them with "" too
                out.append(self.event("response.output_text.delta", content_index=0, delta="", logprobs=self.pending,
                                      **where))
            logprobs, self._item_logprobs, self.pending = self._item_logprobs + self.pending, [], []
            item.content = [OutputText(text=text, logprobs=logprobs if self.logprobs else None)]
            out.append(self.event("response.output_text.done", content_index=0, text=text, logprobs=logprobs, **where))
            out.append(self.event("response.content_part.done", content_index=0, part=item.content[0].model_dump(),
                                  **where))
        elif isinstance(item, OutputReasoning):
            item.content = [ReasoningText(text=text)]
            out.append(self.event("response.reasoning_text.done", content_index=0, text=text, **where))
            out.append(self.event("response.content_part.done", content_index=0, part=item.content[0].model_dump(),
                                  **where))
        else:
            item.arguments = text
            out.append(self.event("response.function_call_arguments.done", arguments=text, name=item.name, **where))
        forced_call = self.forced and isinstance(item, OutputFunctionCall)
        item.status = status if isinstance(item, OutputMessage) or forced_call else "completed"
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=item.model_dump()))
        return out


def output_logprobs(chat: OpenAIServingChat, request: ChatCompletionRequest, choice, tok_start: int,
                    tok_end: int) -> list[dict[str, Any]]:
    """The output_text logprobs of tokens [tok_start, tok_end): chat's, {token, logprob, bytes, top_logprobs}."""
    logprobs = chat_logprobs(chat.tokenizer, choice, tok_start, tok_end, chat.top_count(request.top_logprobs or 0),
                             request.return_tokens_as_token_ids)
    return [entry.model_dump() for entry in (logprobs.content if logprobs is not None else None) or ()]


async def response_events(r: ResponseRun) -> AsyncIterator[str]:
    """The event stream of one admitted Responses request (see the module docstring); aborts its engine request
    however it ends."""
    tools = ToolStream(r.chat_request, r.chat.tool_parser)
    request = r.chat_request
    writer = ResponseEventWriter(forced=tools.mode in ("required", "named"), logprobs=request.logprobs)
    tracker = DeltaTracker()
    thinking = ReasoningStream(parser_for_request(r.chat.reasoning_parser, r.chat_request))
    try:
        start = r.response([], None).model_dump(by_alias=True)
        yield writer.event("response.created", response=start)
        yield writer.event("response.in_progress", response=start)
        last = None
        async for output in r.run.streams[0]:
            last = output
            for d in tracker.deltas(0, output):
                if request.logprobs:
                    writer.pending += output_logprobs(r.chat, request, d.choice, d.tok_start, d.tok_end)
                reasoning, d = thinking.split(d)  # the tool stream sees the content alone, as chat's
                for event in (writer.reasoning(reasoning) if reasoning else []):
                    yield event
                for delta in tools.deltas(d):
                    for event in writer.delta(delta):
                        yield event
        cut = last is not None and last.choices[0].finish_reason == "length"
        for event in writer.close("incomplete" if cut else "completed"):
            yield event
        for item in writer.items if cut and writer.forced else ():  # a cut list's earlier calls too (unparsed)
            if isinstance(item, OutputFunctionCall):
                item.status = "incomplete"
        final = r.response(writer.items, last).model_dump(by_alias=True)
        yield writer.event("response.completed", response=final)
    except Exception as e:
        yield sse_error(e)
    finally:
        r.chat.abort_all(r.run.ids)
