"""POST /v1/completions: one engine request per prompt, n choices each, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from fxrewrite.runtime.server.async_engine import StepOutput
from fxrewrite.runtime.server.logprobs import completion_logprobs, concat_logprobs, echo_logprobs
from fxrewrite.runtime.server.protocol import CompletionRequest
from fxrewrite.runtime.server.protocol_responses import (
    CompletionChoice,
    CompletionResponse,
    CompletionStreamResponse,
    UsageInfo,
)
from fxrewrite.runtime.server.request_params import (best_of_choices, prompt_logprobs_json, request_cache_salt,
                                                      structured_outputs_field, structured_outputs_of)
from fxrewrite.runtime.server.serving_engine import OpenAIServing
from fxrewrite.runtime.server.streaming import (
    DeltaTracker,
    EventStreamResponse,
    cancel_on_disconnect,
    final_outputs,
    merge_async_iterators,
    sse,
    sse_error,
)


class OpenAIServingCompletion(OpenAIServing):
    """Handles `CompletionRequest`s."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request):
        model = self.model_name(request.model)
        prompts = [await self._encode(request, p) for p in request.prompts()]
        explicit = "max_tokens" in request.model_fields_set
        # echo + logprobs: the prompt's own logprobs come first (lm-eval's loglikelihood requests).
        echo_lp = request.logprobs if request.echo and request.logprobs is not None else None
        structured = structured_outputs_of(request)
        inputs = []
        for _, token_ids in prompts:
            max_tokens = self.max_tokens_for(request, len(token_ids), explicit)  # echo-only (0): the 1 token made
            params = self.sampling_params(request, max_tokens, request.logprobs, echo_lp, structured)
            inputs.append((token_ids, params))
        await self.check_structured_outputs(inputs[0][1], structured_outputs_field(request))
        request_id, engine_id = self.request_ids("cmpl", raw_request, request)
        echo_field = ("echo", "echo with logprobs") if echo_lp is not None and request.prompt_logprobs is None \
            else "prompt_logprobs"  # what set SamplingParams.prompt_logprobs, for a refusal to name
        ids, streams = await self.start_requests(engine_id, inputs, structured_field=structured_outputs_field(request),
                                                 prompt_logprobs_field=echo_field,
                                                 cache_salt=request_cache_salt(request))
        echo_texts = [text if request.echo else "" for text, _ in prompts]
        if request.stream:
            events = self._stream(request, model, request_id, ids, streams, echo_texts)
            return EventStreamResponse(events, on_close=lambda: self.abort_all(ids))
        try:
            finals = await cancel_on_disconnect(final_outputs(streams), raw_request)
        finally:
            self.abort_all(ids)
        response = self._response(request, model, request_id, finals, echo_texts)
        return JSONResponse(response.model_dump())

    async def _encode(self, request: CompletionRequest, prompt: str | list[int]) -> tuple[str, list[int]]:
        """(prompt text, prompt token ids), off the event loop; token-id prompts are range-checked, and they
        and truncated prompts (`truncate_prompt_tokens`) decoded for echo."""
        if isinstance(prompt, str):
            token_ids = await self.async_tokenizer.run(self.encode_prompt, request, prompt,
                                                       add_special_tokens=request.add_special_tokens)
            kept = self.truncate_prompt(request, token_ids)
            return (prompt if len(kept) == len(token_ids) else await self.async_tokenizer.decode(kept)), kept
        token_ids = self.truncate_prompt(request, self.check_token_ids(list(prompt)))
        return await self.async_tokenizer.decode(token_ids), token_ids

    def _choices(self, request: CompletionRequest, prompt_index: int, output: StepOutput,
                 echo_text: str) -> list[CompletionChoice]:
        choices, prompt_only = [], request.max_tokens == 0
        outs = output.choices
        if request.best_of is not None and request.best_of > request.n:
            outs = best_of_choices(list(outs), request.n)
        for c in outs:
            logprobs = None
            if request.logprobs is not None:
                as_ids, top = request.return_tokens_as_token_ids, self.top_count(request.logprobs)
                logprobs = None if prompt_only else completion_logprobs(
                    self.tokenizer, c, 0, len(c.token_ids), top, len(echo_text), as_ids)
                if request.echo:
                    prompt_part = echo_logprobs(self.tokenizer, output.prompt_token_ids, output.prompt_logprobs,
                                                top, as_ids)
                    logprobs = concat_logprobs(prompt_part, logprobs)
            choices.append(CompletionChoice(
                index=prompt_index * request.n + c.index, text=echo_text + ("" if prompt_only else c.text),
                logprobs=logprobs, finish_reason="length" if prompt_only else c.finish_reason,
                stop_reason=None if prompt_only else c.stop_reason,
                prompt_logprobs=prompt_logprobs_json(output.prompt_logprobs) if request.prompt_logprobs is not None
                else None))
        return choices

    def _response(self, request: CompletionRequest, model: str, request_id: str,
                  finals: list[StepOutput], echo_texts: list[str]) -> CompletionResponse:
        choices = []
        for i, output in enumerate(finals):
            choices.extend(self._choices(request, i, output, echo_texts[i]))
        usage = self.with_cached_tokens(_usage(finals), sum(o.num_cached_tokens for o in finals))
        if request.max_tokens == 0:  # the one token generated for nothing is not reported
            usage = UsageInfo(prompt_tokens=usage.prompt_tokens, completion_tokens=0, total_tokens=usage.prompt_tokens,
                              prompt_tokens_details=usage.prompt_tokens_details)
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    async def _stream(self, request: CompletionRequest, model: str, request_id: str, ids: list[str],
                      streams: list[AsyncIterator[StepOutput]], echo_texts: list[str]) -> AsyncIterator[str]:
        created = int(time.time())
        tracker = DeltaTracker()  # the engine already holds back a possible stop string's prefix
        last: dict[int, StepOutput] = {}
        try:
            async for i, output in merge_async_iterators(*streams):
                last[i] = output
                for d in tracker.deltas(i, output):
                    echo = echo_texts[i] if d.is_first else ""
                    text = echo + d.text
                    logprobs = None
                    if request.logprobs is not None:
                        as_ids, top = request.return_tokens_as_token_ids, self.top_count(request.logprobs)
                        logprobs = completion_logprobs(self.tokenizer, d.choice, d.tok_start, d.tok_end,
                                                       top, d.text_start + len(echo_texts[i]), as_ids)
                        if request.echo and d.is_first:
                            logprobs = concat_logprobs(echo_logprobs(
                                self.tokenizer, output.prompt_token_ids, output.prompt_logprobs, top,
                                as_ids), logprobs)
                    choice = CompletionChoice(
                        index=i * request.n + d.choice.index, text=text, logprobs=logprobs,
                        finish_reason=d.choice.finish_reason if d.finished else None,
                        stop_reason=d.choice.stop_reason if d.finished else None)
                    usage = (UsageInfo.of(output.num_prompt_tokens, len(d.choice.token_ids))
                             if request.continuous_usage() else None)
                    chunk = CompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice],
                                                     usage=usage)
                    yield sse(chunk.model_dump_json())
            if request.include_usage():
                outputs = list(last.values())
                usage = self.with_cached_tokens(_usage(outputs), sum(o.num_cached_tokens for o in outputs))
                chunk = CompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                 usage=usage)
                yield sse(chunk.model_dump_json())
        except Exception as e:
            yield sse_error(e)
        finally:
            self.abort_all(ids)
        yield sse("[DONE]")


def _usage(outputs: list[StepOutput]) -> UsageInfo:
    prompt = sum(o.num_prompt_tokens for o in outputs)
    completion = sum(o.num_generated_tokens for o in outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
