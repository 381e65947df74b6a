"""POST /v1/responses: OpenAI's Responses API, served on the chat path.

A `ResponsesRequest` becomes a `ChatCompletionRequest` (`ResponsesRequest.to_chat_request`), which
`OpenAIServingChat.prepare` checks, renders through the chat template and admits to the engine as it does a chat
request (the same 400s, sampling defaults, tool and structured-output constraints, metrics and KV-block lifecycle:
the engine request is aborted however the response ends). The finished text is split as chat splits it
(`OpenAIServingChat.parse_choice`: reasoning, content, tool calls) into output items: a reasoning item, an
assistant message (one output_text part), function_call items. Streamed, the events are `responses_stream`'s.

As vLLM without its response store: nothing is stored, so `previous_response_id` is a 404 (vLLM's "not found",
saying why) and `background` a 400; `store` is accepted and ignored.
"""

from __future__ import annotations

import time
from http import HTTPStatus

from fastapi import Request
from fastapi.responses import JSONResponse

from fxrewrite.runtime.server.async_engine import StepOutput
from fxrewrite.runtime.server.errors import OpenAIError
from fxrewrite.runtime.server.protocol import ChatCompletionRequest, random_id
from fxrewrite.runtime.server.reasoning import END, START, ReasoningParser, parser_for_request
from fxrewrite.runtime.server.responses_protocol import (
    RESPONSES_FIELD,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponsesRequest,
    ResponsesResponse,
    ResponsesUsage,
    new_id,
    renamed,
)
from fxrewrite.runtime.server.responses_stream import ResponseRun, output_logprobs, response_events
from fxrewrite.runtime.server.serving_chat import ChatRun, OpenAIServingChat
from fxrewrite.runtime.server.streaming import EventStreamResponse, cancel_on_disconnect, final_outputs
from fxrewrite.runtime.server.tools import tool_mode
from fxrewrite.runtime.server.validation_errors import FieldError


class OpenAIServingResponses:
    """Handles `ResponsesRequest`s through `chat` (its template, tool parser, reasoning parser and engine)."""

    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat

    async def create_response(self, request: ResponsesRequest, raw_request: Request):
        """The response object (JSON), or its event stream when `request.stream`. OpenAIError for what cannot be
        served (400 naming the field, 404 for a model or a previous response this server does not have)."""
        if request.previous_response_id is not None:
            raise not_stored(request.previous_response_id, param="previous_response_id")
        try:
            chat_request = request.to_chat_request(fold_developer="developer" not in (self.chat.template() or ""))
        except FieldError as e:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, str(e), param=e.param, code="invalid_value") from None
        chat_request = await self.truncated(request, chat_request)
        given = (request.model_extra or {}).get("request_id")  # vLLM's field: the response's id
        response_id = given if isinstance(given, str) and given else new_id("resp")
        try:
            run = await self.chat.prepare(chat_request, raw_request, (response_id, random_id(response_id)))
        except OpenAIError as e:  # in this request's words (max_output_tokens, not max_tokens)
            raise OpenAIError(e.status, renamed(e.message), param=RESPONSES_FIELD.get(e.param, e.param),
                              code=e.code) from None
        created_at = int(time.time())
        if request.stream:  # every event's response object is created at the request's time
            events = response_events(ResponseRun(self.chat, chat_request, run, lambda *args: self.response(
                request, chat_request, run, *args, created_at=created_at)))
            return EventStreamResponse(events, on_close=lambda: self.chat.abort_all(run.ids))
        try:
            (final,) = await cancel_on_disconnect(final_outputs(run.streams), raw_request)
        finally:
            self.chat.abort_all(run.ids)
        output = self.output_items(chat_request, final)
        response = self.response(request, chat_request, run, output, final, created_at=created_at)
        return JSONResponse(response.model_dump(by_alias=True))

    async def truncated(self, request: ResponsesRequest, chat_request: ChatCompletionRequest) -> ChatCompletionRequest:
        """`chat_request`, or under `truncation: "auto"` (OpenAI's rule: items dropped from the beginning of the
        conversation) its messages after the fewest oldest ones whose prompt leaves room for max_output_tokens (one
        token when unset) in max_model_len and the KV cache. The leading system messages (instructions) stay; tool
        outputs left first lose their call, so they go with it; the last message always stays (when it alone does
        not fit, the chat path's 400 says so). Each try renders the chat template (a binary search: log2(items))."""
        if request.truncation != "auto":
            return chat_request
        chat, messages = self.chat, chat_request.messages
        limit = min(chat.max_model_len - (request.max_output_tokens or 1), chat.max_seq_len - 1)
        first = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages) - 1)

        def dropping(n: int) -> ChatCompletionRequest:
            start = first + n
            while start < len(messages) - 1 and messages[start].role == "tool":
                start += 1
            return chat_request.model_copy(update={"messages": messages[:first] + messages[start:]})

        async def fits(n: int) -> bool:
            return len(await chat.async_tokenizer.run(chat.apply_chat_template, dropping(n))) <= limit

        low, high = 0, len(messages) - 1 - first  # high: only the last message left
        if high <= 0 or await fits(0):
            return chat_request
        while low + 1 < high:  # fits(high) is assumed: at the end the chat path checks it
            middle = (low + high) // 2
            low, high = (low, middle) if await fits(middle) else (middle, high)
        return dropping(high)

    def output_items(self, chat_request: ChatCompletionRequest, final: StepOutput) -> list[OutputItem]:
        """The output items of a finished request: reasoning (when the reasoning parser found some), the message
        (when there is content), then one function_call item per parsed call."""
        choice = final.choices[0]
        reasoning, content, calls = self.chat.parse_choice(chat_request, choice.text)
        items: list[OutputItem] = []
        if reasoning:
            items.append(OutputReasoning(content=[ReasoningText(text=reasoning)]))
        cut = choice.finish_reason == "length"
        if content:  # the length cut it unless calls follow it (as the stream closes it when a call starts)
            status = "incomplete" if cut and not calls else "completed"
            logprobs = output_logprobs(self.chat, chat_request, choice, 0, len(choice.token_ids)) if (
                chat_request.logprobs) else None  # the whole output's tokens, as the stream sends them
            items.append(OutputMessage(status=status, content=[OutputText(text=content, logprobs=logprobs)]))
        status = "incomplete" if cut and forced_calls(chat_request) else "completed"  # a forced call cut short
        items += [OutputFunctionCall(call_id=c.id, name=c.function.name, arguments=c.function.arguments,
                                     status=status) for c in calls]
        return items

    def response(self, request: ResponsesRequest, chat_request: ChatCompletionRequest, run: ChatRun,
                 output: list[OutputItem], final: StepOutput | None, created_at: int) -> ResponsesResponse:
        """The response object: "in_progress" without `final` (a stream's first events), else "completed", or
        "incomplete" when max_output_tokens (or the context) cut the output, with its usage."""
        status, details, usage = "in_progress", None, None
        if final is not None:
            status = "incomplete" if final.choices[0].finish_reason == "length" else "completed"
            details = {"reason": "max_output_tokens"} if status == "incomplete" else None
            usage = self.usage(chat_request, final)
        choice = request.tool_choice
        return ResponsesResponse(
            id=run.request_id, created_at=created_at, model=run.model, status=status, incomplete_details=details, output=output,
            usage=usage, instructions=request.instructions, metadata=request.metadata,
            parallel_tool_calls=request.parallel_tool_calls, temperature=run.params.temperature,
            top_p=run.params.top_p, max_output_tokens=run.params.max_tokens,
            tool_choice=choice if isinstance(choice, str) else choice.model_dump(),
            tools=[t.model_dump(exclude_none=True) for t in request.tools],
            text=request.text.model_dump(by_alias=True, exclude_none=True),
            reasoning=request.reasoning.model_dump() if request.reasoning is not None else None,
            service_tier=request.service_tier, user=request.user, truncation=request.truncation,
            top_logprobs=chat_request.top_logprobs if chat_request.logprobs else None)

    def usage(self, chat_request: ChatCompletionRequest, final: StepOutput) -> ResponsesUsage:
        """Tokens in and out; cached_tokens: the input tokens the prefix cache served; reasoning_tokens: the output
        tokens of the think block."""
        parser = parser_for_request(self.chat.reasoning_parser, chat_request)
        reasoning = reasoning_tokens(self.chat.tokenizer, parser, final.choices[0])
        return ResponsesUsage(
            input_tokens=final.num_prompt_tokens, output_tokens=final.num_generated_tokens,
            total_tokens=final.num_prompt_tokens + final.num_generated_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=final.num_cached_tokens),
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning))


def not_stored(response_id: str, param: str | None = None) -> OpenAIError:
    """vLLM's 404 for a response id, without its store: nothing is kept to continue, retrieve or cancel."""
    return OpenAIError(HTTPStatus.NOT_FOUND, f"Response with id '{response_id}' not found: this server does not "
                       "store responses (as vLLM without VLLM_ENABLE_RESPONSES_API_STORE); send the whole "
                       "conversation in `input` instead", param=param, code="response_not_found")


def forced_calls(chat_request: ChatCompletionRequest) -> bool:
    """True when tool_choice forces the calls (required or a named function): the output is the calls' JSON, so a
    length cut leaves the last call's arguments unfinished (or, under required, the list unparsed)."""
    return bool(chat_request.tools) and tool_mode(chat_request) in ("required", "named")


def reasoning_tokens(tokenizer, parser: ReasoningParser | None, choice) -> int:
    """How many of a finished choice's tokens are its think block's text (0 without a parser or reasoning). When
    the model wrote `</think>` as its one token (as Qwen3 and DeepSeek-R1 do), the tokens before it, less a leading
    `<think>` token; else (the tags spelt in pieces, or a block never closed) the reasoning text's own token count
    (re-encoded: the model's tokens cannot be split at a tag that falls inside one)."""
    reasoning = parser.extract(choice.text)[0] if parser is not None else None
    if not reasoning:
        return 0
    ids = list(choice.token_ids)
    end, start = (tokenizer.convert_tokens_to_ids(tag) for tag in (END, START))
    if isinstance(end, int) and end in ids:
        return ids.index(end) - (1 if ids[0] == start else 0)
    return len(tokenizer.encode(reasoning, add_special_tokens=False))
