"""POST /v1/chat/completions: messages through the tokenizer's chat template, then one engine request."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus

from fastapi import Request
from fastapi.responses import JSONResponse

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.engine.chat import (ChatTemplateError, as_content_format, check_generation_mode,
                                           check_template_kwargs, check_template_syntax, render_chat,
                                           template_renders_tools)
from fxrewrite.runtime.server.async_engine import StepOutput
from fxrewrite.runtime.server.errors import OpenAIError
from fxrewrite.runtime.server.logprobs import chat_logprobs
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.server.protocol import ChatCompletionRequest, ToolCall
from fxrewrite.runtime.server.reasoning import ReasoningParser, ReasoningStream, parser_for_request
from fxrewrite.runtime.server.protocol_responses import (
    ChatChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from fxrewrite.runtime.server.request_params import (best_of_choices, prompt_logprobs_json, request_cache_salt,
                                                      structured_outputs_field, structured_outputs_of)
from fxrewrite.runtime.server.serving_engine import OpenAIServing
from fxrewrite.runtime.server.tool_parsers import ToolParser
from fxrewrite.runtime.server.tool_stream import ToolStream
from fxrewrite.runtime.server.tools import (
    check_template_renders_tools,
    finish_reason,
    forced_tool_outputs,
    parse_output,
    tool_mode,
)
from fxrewrite.runtime.server.streaming import (
    DeltaTracker,
    EventStreamResponse,
    cancel_on_disconnect,
    final_outputs,
    sse,
    sse_error,
)


@dataclass
class ChatRun:
    """A chat request admitted to the engine (`OpenAIServingChat.prepare`): the name its response carries, the
    response's id, its engine requests' ids and output streams (one), its prompt's length and its sampling
    parameters."""

    model: str
    request_id: str
    ids: list[str]
    streams: list[AsyncIterator[StepOutput]]
    num_prompt_tokens: int
    params: SamplingParams


class OpenAIServingChat(OpenAIServing):
    """Handles `ChatCompletionRequest`s.

    chat_template: a template (text) used instead of the tokenizer's (`--chat-template`).
    tool_parser: the parser of tool_choice "auto" (None: "auto" is refused, as vLLM does without
    `--enable-auto-tool-choice`). reasoning_parser: splits a reply's think block into `reasoning` (None: the
    text is all content), vLLM's `--reasoning-parser`. trust_request_chat_template: a request's own `chat_template` is used
    (else it is a 400), vLLM's `--trust-request-chat-template`.
    """

    def __init__(self, *args, chat_template: str | None = None, tool_parser: ToolParser | None = None,
                 trust_request_chat_template: bool = False, reasoning_parser: ReasoningParser | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template
        self.tool_parser = tool_parser
        self.trust_request_chat_template = trust_request_chat_template
        self.reasoning_parser = reasoning_parser
        self.content_format = "string"
        """vLLM's --chat-template-content-format: "string" (text parts joined) or "openai" (lists of text parts)."""

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request):
        run = await self.prepare(request, raw_request)
        if request.stream:
            return EventStreamResponse(self._stream(request, run.model, run.request_id, run.ids, run.streams[0],
                                                    run.num_prompt_tokens), on_close=lambda: self.abort_all(run.ids))
        try:
            (final,) = await cancel_on_disconnect(final_outputs(run.streams), raw_request)
        finally:
            self.abort_all(run.ids)
        return JSONResponse(self._response(request, run.model, run.request_id, final).model_dump())

    async def prepare(self, request: ChatCompletionRequest, raw_request: Request,
                      request_ids: tuple[str, str] | None = None) -> ChatRun:
        """Everything a chat request does before its output: the checks (400s before anything is allocated), the
        prompt, the sampling parameters, the engine requests. `request_ids`: (the response's id, the base of its
        engine requests' ids); default chat's (`request_ids("chatcmpl", ...)`). The caller must
        `abort_all(run.ids)` when done (the Responses API runs its requests through here too)."""
        model = self.model_name(request.model)
        structured = self._check_tools(request)
        token_ids = await self.async_tokenizer.run(self.apply_chat_template, request)  # off the event loop
        token_ids = self.truncate_prompt(request, token_ids)
        explicit = bool({"max_tokens", "max_completion_tokens"} & request.model_fields_set)
        max_tokens = self.max_tokens_for(request, len(token_ids), explicit)
        num_top = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, num_top, None, structured)
        if tool_mode(request) == "auto" and self.tool_parser.needs_special_tokens:
            params.skip_special_tokens = False
        await self.check_structured_outputs(params, structured_outputs_field(request))
        request_id, engine_id = request_ids or self.request_ids("chatcmpl", raw_request, request)
        field = structured_outputs_field(request)
        ids, streams = await self.start_requests(engine_id, [(token_ids, params)], logprobs_field="top_logprobs",
                                                 structured_field="tool_choice" if field == "tools" else field,
                                                 prompt_field="messages", cache_salt=request_cache_salt(request))
        return ChatRun(model, request_id, ids, streams, len(token_ids), params)

    def parse_choice(self, request: ChatCompletionRequest, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, tool calls) of a finished choice's text: the think block split off
        (--reasoning-parser), then the calls parsed from the rest under the request's tool_choice."""
        reasoning_parser = parser_for_request(self.reasoning_parser, request)
        reasoning, text = reasoning_parser.extract(text) if reasoning_parser else (None, text)
        content, calls = parse_output(request, text, self.tool_parser) if text is not None else (None, [])
        return reasoning, content, calls

    def template(self, request: ChatCompletionRequest | None = None) -> str | None:
        """`request`'s own chat template (see `request_chat_template`), else --chat-template, else the
        tokenizer's; None when there is none."""
        own = request_chat_template(request, self.trust_request_chat_template) if request is not None else None
        return own or self.chat_template or getattr(self.tokenizer, "chat_template", None)

    def _check_tools(self, request: ChatCompletionRequest):
        """The request's output constraint (tool_choice required / named force one); 400 for what cannot
        be served."""
        structured = structured_outputs_of(request)
        mode = tool_mode(request)
        if not request.tools or mode == "none":
            return structured
        check_template_renders_tools(self.template(request))
        if mode == "auto" and self.tool_parser is None:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, '"auto" tool choice requires --enable-auto-tool-choice '
                              "(and --tool-call-parser) to be set", param="tool_choice", code="invalid_value")
        forced = forced_tool_outputs(request)
        if forced is not None and structured is not None:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, f"tool_choice {mode!r} cannot be combined with another "
                              f"output constraint ({structured_outputs_field(request)})", param="tool_choice",
                              code="invalid_value")
        return forced or structured

    def apply_chat_template(self, request: ChatCompletionRequest) -> list[int]:
        """Prompt token ids of the messages, rendered by the chat template (400 if it fails). Blocking:
        the handlers run it in the tokenizer thread."""
        own = request_chat_template(request, self.trust_request_chat_template)
        template = own or self.template()
        if template is None:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, "this model's tokenizer has no chat template; "
                              "use /v1/completions or start the server with --chat-template",
                              param="messages", code="no_chat_template")
        try:
            messages = _template_messages(request, self.content_format)
        except ValueError as e:
            named = str(e).startswith(("messages.", "messages["))  # names the message at fault
            raise OpenAIError(HTTPStatus.BAD_REQUEST, str(e) if named else f"messages: {e}", param="messages",
                              code="invalid_value") from None
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        if tools and tool_mode(request) == "none" and not template_renders_tools(template):
            tools = None  # the answer is plain text: a template that cannot show the tools renders without them
        if tools:
            check_template_renders_tools(template)  # the 400 that names --chat-template
        try:
            check_generation_mode(messages, request.add_generation_prompt, request.continue_final_message)
        except UserInputError as e:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, str(e), param="continue_final_message",
                              code="invalid_value") from None
        kwargs = {k: v for k, v in (request.chat_template_kwargs or {}).items() if k != "chat_template"}
        kwargs = {**_documents(request), **kwargs}  # as vLLM's: chat_template_kwargs win
        try:
            check_template_kwargs(kwargs)
        except UserInputError as e:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, str(e), param="chat_template_kwargs",
                              code="invalid_value") from None
        try:
            text = render_chat(self.tokenizer, messages, chat_template=own or self.chat_template, tools=tools,
                               add_generation_prompt=request.add_generation_prompt,
                               continue_final_message=request.continue_final_message, chat_template_kwargs=kwargs)
        except ChatTemplateError as e:  # jinja2's error, or the template's raise_exception(...)
            error = e.__cause__
        except UserInputError as e:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, str(e), param="tools" if tools else "messages",
                              code="invalid_value") from None
        except Exception as e:  # a template failing otherwise (a filter's TypeError, say)
            error = e
        else:
            error = None
        if error is not None:
            where = "the request's chat_template" if own else "chat template"
            raise OpenAIError(HTTPStatus.BAD_REQUEST, f"{where} failed: {error}",
                              param="chat_template" if own else "messages", code="invalid_value") from None
        # The template already wrote the special tokens (BOS etc.): added again only when asked (vLLM's field).
        return self.encode_prompt(request, text, add_special_tokens=request.add_special_tokens)

    def _response(self, request: ChatCompletionRequest, model: str, request_id: str,
                  final: StepOutput) -> ChatCompletionResponse:
        choices = []
        outs = final.choices
        if request.best_of is not None and request.best_of > request.n:
            outs = best_of_choices(list(outs), request.n)
        for c in outs:
            logprobs = None
            if request.logprobs:
                logprobs = chat_logprobs(self.tokenizer, c, 0, len(c.token_ids),
                                         self.top_count(request.top_logprobs or 0), request.return_tokens_as_token_ids)
            reasoning, content, calls = self.parse_choice(request, c.text)
            if request.echoed_text():
                content = request.echoed_text() + (content or "")
            message = ChatResponseMessage(role=request.response_role(), content=content, tool_calls=calls,
                                          reasoning=reasoning, reasoning_content=reasoning)
            choices.append(ChatChoice(index=c.index, message=message, logprobs=logprobs,
                                      finish_reason=finish_reason(request, c.finish_reason, calls),
                                      stop_reason=c.stop_reason))
        response = ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                          usage=self.with_cached_tokens(_usage(final), final.num_cached_tokens))
        if request.prompt_logprobs is not None:
            response.prompt_logprobs = prompt_logprobs_json(final.prompt_logprobs)
        return response

    async def _stream(self, request: ChatCompletionRequest, model: str, request_id: str, ids: list[str],
                      stream: AsyncIterator[StepOutput], num_prompt_tokens: int) -> AsyncIterator[str]:
        created = int(time.time())
        tracker = DeltaTracker()  # the engine already holds back a possible stop string's prefix
        tools = ToolStream(request, self.tool_parser)
        thinking = ReasoningStream(parser_for_request(self.reasoning_parser, request))
        last = None

        def chunk(choice: ChatStreamChoice, num_tokens: int = 0) -> str:
            usage = UsageInfo.of(num_prompt_tokens, num_tokens) if request.continuous_usage() else None
            body = ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice],
                                                usage=usage)
            return sse(body.model_dump_json())

        try:
            # OpenAI opens each choice with the role and an empty content.
            for index in range(request.n):
                yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role=request.response_role(), content="")))
            if request.echoed_text():  # vLLM sends the echoed message next, one chunk a choice
                for index in range(request.n):
                    yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(content=request.echoed_text())))
            async for output in stream:
                last = output
                for d in tracker.deltas(0, output):
                    new_tokens = request.logprobs and d.tok_end > d.tok_start
                    reasoning, d = thinking.split(d)  # the tool stream sees the content alone
                    deltas = tools.deltas(d)
                    if reasoning:
                        deltas.insert(0, DeltaMessage(reasoning=reasoning, reasoning_content=reasoning))
                    if not deltas and not d.finished and not new_tokens:
                        continue
                    logprobs = None
                    if request.logprobs:
                        logprobs = chat_logprobs(self.tokenizer, d.choice, d.tok_start, d.tok_end,
                                                 self.top_count(request.top_logprobs or 0),
                                                 request.return_tokens_as_token_ids)
                    deltas = deltas or [DeltaMessage()]
                    for j, delta in enumerate(deltas):
                        end = d.finished and j == len(deltas) - 1
                        yield chunk(ChatStreamChoice(
                            index=d.choice.index, delta=delta, logprobs=logprobs if j == 0 else None,
                            finish_reason=tools.finish_reason(d.choice) if end else None,
                            stop_reason=d.choice.stop_reason if end else None), len(d.choice.token_ids))
            if request.include_usage() and last is not None:
                body = ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                    usage=self.with_cached_tokens(_usage(last), last.num_cached_tokens))
                yield sse(body.model_dump_json())
        except Exception as e:
            yield sse_error(e)
        finally:
            self.abort_all(ids)
        yield sse("[DONE]")


def _template_messages(request: ChatCompletionRequest, content_format: str) -> list[dict]:
    """The request's messages as the chat template gets them (`ChatMessage.to_template_dict`), their content in
    `content_format` (`as_content_format`); ValueError naming the message for a part that is not text."""
    messages = [m.to_template_dict(f"messages[{i}]") for i, m in enumerate(request.messages)]
    if content_format == "openai":
        for i, (m, message) in enumerate(zip(request.messages, messages)):
            parts = [p.model_dump() for p in m.content] if isinstance(m.content, list) else message["content"]
            message["content"] = as_content_format(parts, "openai", f"messages[{i}]")
    return messages


def _documents(request: ChatCompletionRequest) -> dict:
    """vLLM's `documents` field (a list of {"title": ..., "text": ...} objects that RAG chat templates read) as
    the template variable of that name; {} when unset; 400 naming the field when it is not a list of objects of
    strings."""
    documents = (request.model_extra or {}).get("documents")
    if documents is None:
        return {}
    if not isinstance(documents, list) or not all(
            isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents):
        raise OpenAIError(HTTPStatus.BAD_REQUEST, f"documents: expected a list of objects of strings (such as "
                          f"{{'title': ..., 'text': ...}}), got {documents!r:.100}", param="documents",
                          code="invalid_value")
    return {"documents": documents}


def _usage(output: StepOutput) -> UsageInfo:
    completion = output.num_generated_tokens
    return UsageInfo(prompt_tokens=output.num_prompt_tokens, completion_tokens=completion,
                     total_tokens=output.num_prompt_tokens + completion)


def request_chat_template(request: ChatCompletionRequest, trusted: bool) -> str | None:
    """A request's own chat template (vLLM's `chat_template` field, or `chat_template_kwargs["chat_template"]`),
    None when it sets none. 400 naming the field when the server does not trust request templates (vLLM's
    rule: a template is code the server runs; `--trust-request-chat-template`), when the value is not
    template text (a request's template is never read from a file, and a path must not become the
    prompt), or when Jinja cannot parse it."""
    given = getattr(request, "chat_template", None)
    param = "chat_template"
    if given is None:
        given, param = (request.chat_template_kwargs or {}).get("chat_template"), "chat_template_kwargs"
    if given is None:
        return None
    if not trusted:
        raise OpenAIError(HTTPStatus.BAD_REQUEST, f"{param}: a chat template is passed with the request, but the "
                          "server does not run request templates; start it with --trust-request-chat-template "
                          "(or --chat-template for every request)", param=param, code="invalid_value")
    if not isinstance(given, str) or not any(c in given for c in "{}\n"):
        raise OpenAIError(HTTPStatus.BAD_REQUEST, f"{param}: {given!r:.100} is not a Jinja template (a request's "
                          "chat_template is the template text; the server reads no file for a request)",
                          param=param, code="invalid_value")
    try:
        check_template_syntax(given, param)
    except UserInputError as e:
        raise OpenAIError(HTTPStatus.BAD_REQUEST, str(e), param=param, code="invalid_value") from None
    return given