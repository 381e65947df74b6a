"""POST /v1/chat/completions: messages through the tokenizer's chat template, then one engine request."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from http import HTTPStatus

from fastapi import Request
from fastapi.responses import JSONResponse

from fxrewrite.runtime.server.async_engine import StepOutput
from fxrewrite.runtime.server.errors import OpenAIError
from fxrewrite.runtime.server.logprobs import chat_logprobs
from fxrewrite.runtime.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from fxrewrite.runtime.server.serving_engine import OpenAIServing
from fxrewrite.runtime.server.streaming import (
    DeltaTracker,
    EventStreamResponse,
    cancel_on_disconnect,
    final_outputs,
    sse,
    sse_error,
    stop_holdback,
)


class OpenAIServingChat(OpenAIServing):
    """Handles `ChatCompletionRequest`s."""

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request):
        model = self.model_name(request.model)
        token_ids = self.apply_chat_template(request)
        explicit = bool({"max_tokens", "max_completion_tokens"} & request.model_fields_set)
        max_tokens = self.max_tokens_for(request, len(token_ids), explicit)
        num_top = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, num_top)
        request_id = random_id("chatcmpl")
        ids, streams = await self.start_requests(request_id, [(token_ids, params)])
        if request.stream:
            return EventStreamResponse(self._stream(request, model, request_id, ids, streams[0]),
                                       on_close=lambda: self.abort_all(ids))
        try:
            (final,) = await cancel_on_disconnect(final_outputs(streams), raw_request)
        finally:
            self.abort_all(ids)
        return JSONResponse(self._response(request, model, request_id, final).model_dump())

    def apply_chat_template(self, request: ChatCompletionRequest) -> list[int]:
        """Prompt token ids of the messages, rendered by the tokenizer's chat template (400 if it fails)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, "this model's tokenizer has no chat template; "
                              "use /v1/completions", param="messages", code="no_chat_template")
        try:
            messages = [m.to_template_dict() for m in request.messages]
        except ValueError as e:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, f"messages: {e}", param="messages",
                              code="invalid_value") from None
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=request.add_generation_prompt,
                **(request.chat_template_kwargs or {}))
        except Exception as e:  # jinja2 TemplateError, or a template's raise_exception(...)
            raise OpenAIError(HTTPStatus.BAD_REQUEST, f"chat template failed: {e}", param="messages",
                              code="invalid_value") from None
        # The template already wrote the special tokens (BOS etc.); do not add them twice.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _response(self, request: ChatCompletionRequest, model: str, request_id: str,
                  final: StepOutput) -> ChatCompletionResponse:
        choices = []
        for c in final.choices:
            logprobs = None
            if request.logprobs:
                logprobs = chat_logprobs(self.tokenizer, c, 0, len(c.token_ids), request.top_logprobs or 0)
            choices.append(ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                                      logprobs=logprobs, finish_reason=c.finish_reason,
                                      stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=_usage(final))

    async def _stream(self, request: ChatCompletionRequest, model: str, request_id: str, ids: list[str],
                      stream: AsyncIterator[StepOutput]) -> AsyncIterator[str]:
        created = int(time.time())
        tracker = DeltaTracker(stop_holdback(request.stop))
        last = None

        def chunk(choice: ChatStreamChoice) -> str:
            body = ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice])
            return sse(body.model_dump_json())

        try:
            # OpenAI opens each choice with the role and an empty content.
            for index in range(request.n):
                yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
            async for output in stream:
                last = output
                for d in tracker.deltas(0, output):
                    new_tokens = request.logprobs and d.tok_end > d.tok_start
                    if not d.text and not d.finished and not new_tokens:
                        continue
                    logprobs = None
                    if request.logprobs:
                        logprobs = chat_logprobs(self.tokenizer, d.choice, d.tok_start, d.tok_end,
                                                 request.top_logprobs or 0)
                    yield chunk(ChatStreamChoice(
                        index=d.choice.index, delta=DeltaMessage(content=d.text or None), logprobs=logprobs,
                        finish_reason=d.choice.finish_reason if d.finished else None,
                        stop_reason=d.choice.stop_reason if d.finished else None))
            if request.include_usage() and last is not None:
                body = ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                    usage=_usage(last))
                yield sse(body.model_dump_json())
        except Exception as e:
            yield sse_error(e)
        finally:
            self.abort_all(ids)
        yield sse("[DONE]")


def _usage(output: StepOutput) -> UsageInfo:
    completion = output.num_generated_tokens
    return UsageInfo(prompt_tokens=output.num_prompt_tokens, completion_tokens=completion,
                     total_tokens=output.num_prompt_tokens + completion)
