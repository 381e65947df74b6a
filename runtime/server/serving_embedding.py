"""POST /v1/embeddings (OpenAI's shape) for a server started with `--runner pooling`.

Request: `input` is a string, a list of strings, a list of token ids or a list of such lists, or
(vLLM's EmbeddingChatRequest) `messages`, chat messages rendered by the chat template as /v1/chat/completions
renders them (`add_generation_prompt` default false there, `continue_final_message`, `chat_template`,
`chat_template_kwargs`), one embedding; exactly one of the two. `add_special_tokens` (vLLM's): default true
for `input`, false for `messages` (the template writes them). `encoding_format` "float" (lists of floats) or "base64" (the little-endian float32 bytes, base64, as
OpenAI sends them); `dimensions` (a Matryoshka embedding's first values, normalised after the cut) only for a
model whose config says `is_matryoshka` or lists `matryoshka_dimensions`, else a 400, as vLLM. Response:
{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage":
{"prompt_tokens", "total_tokens"}}. Every input is checked (empty, longer than max_model_len, token
ids out of range) before any is queued. A server that generates answers 400, as vLLM does for a
model without the embedding task.
"""

from __future__ import annotations

import base64
import time
from http import HTTPStatus
from typing import Any, Literal

import numpy as np
from fastapi import Request
from pydantic import Field, StrictBool

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.engine.pooling import PoolingParams, check_dimensions
from fxrewrite.runtime.server.errors import OpenAIError
from fxrewrite.runtime.server.prompt_bound import PromptTooLong, encode_bounded
from fxrewrite.runtime.server.protocol import ChatMessage, OpenAIBaseModel, RequestInt, RequestModel
from fxrewrite.runtime.server.serving_engine import OpenAIServing
from fxrewrite.runtime.server.serving_tokenize import template_request

# EmbeddingChatRequest's fields that only messages use: sent with input, they are a 400 (they would do nothing).
_CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs")


class EmbeddingRequest(RequestModel):
    model: str | None = None
    input: str | list[str] | list[RequestInt] | list[list[RequestInt]] | None = None
    messages: list[ChatMessage] | None = None  # vLLM's EmbeddingChatRequest, instead of input
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: RequestInt | None = None
    user: str | None = None
    truncate_prompt_tokens: RequestInt | None = Field(None, ge=-1)  # vLLM's: keep each input's last k tokens
    normalize: StrictBool | None = None  # vLLM's: L2-normalise each embedding (None: the default, True)
    add_special_tokens: StrictBool | None = None  # vLLM's; None: True for input, False for messages
    add_generation_prompt: StrictBool = False  # EmbeddingChatRequest's default, unlike chat's
    continue_final_message: StrictBool = False
    chat_template: str | None = None  # a request's own template: needs --trust-request-chat-template, as chat
    chat_template_kwargs: dict[str, Any] | None = None


class EmbeddingData(OpenAIBaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def encode_embedding(values: list[float], encoding_format: str) -> list[float] | str:
    """floats as they are, or base64 of their little-endian float32 bytes (OpenAI's base64 format)."""
    if encoding_format == "float":
        return values
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")


class OpenAIServingEmbedding(OpenAIServing):
    """Embeddings over the async engine of a pooling runner.

    Args: `OpenAIServing`'s, and chat: the server's `OpenAIServingChat`, whose chat template path renders a
    request's `messages` (None: `messages` is a 400).
    """

    def __init__(self, *args, chat=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.chat = chat

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> EmbeddingResponse:
        model = self.model_name(request.model)
        if not self.engine.engine.config.is_pooling:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, "The model does not support the Embeddings API: this server "
                              "generates; start it with `fxrewrite serve MODEL --runner pooling` for embeddings",
                              param="model", code="model_not_supported")
        config = self.engine.engine.model_config
        try:
            check_dimensions(request.dimensions, config.hf_config, config.hidden_size)
        except UserInputError as e:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, str(e), param="dimensions", code="invalid_value") from None
        _check_input_or_messages(request)
        prompts = await self.async_tokenizer.run(self._prompts, request)
        request_id, engine_id = self.request_ids("embd", raw_request, request)
        params = PoolingParams(normalize=request.normalize is not False, dimensions=request.dimensions)
        ids, streams = await self.start_requests(engine_id, [(p, params) for p in prompts], prompt_field="input")
        try:
            data = []
            for index, stream in enumerate(streams):
                last = None
                async for output in stream:
                    last = output
                data.append(EmbeddingData(index=index, embedding=encode_embedding(list(last.embedding),
                                                                                  request.encoding_format)))
        finally:
            self.abort_all(ids)
        tokens = sum(len(p) for p in prompts)
        return EmbeddingResponse(id=request_id, created=int(time.time()), model=model, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))

    def _prompts(self, request: EmbeddingRequest) -> list[list[int]]:
        """Token ids per input (truncated as `truncate_prompt_tokens` says); 400 naming the input for an empty
        one or one over max_model_len."""
        if request.messages is not None:
            return [self._checked(request, self._render(request), "messages")]
        given = request.input
        if isinstance(given, str) or (isinstance(given, list) and given and isinstance(given[0], int)):
            given = [given]
        if not given:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, "input is empty: give a string, a list of strings, a "
                              "list of token ids or a list of such lists", param="input", code="invalid_value")
        prompts = []
        for i, item in enumerate(given):
            where = "input" if len(given) == 1 else f"input[{i}]"
            ids = self._encode(request, item, where) if isinstance(item, str) else self.check_token_ids(item, where)
            prompts.append(self._checked(request, ids, where))
        return prompts

    def _checked(self, request: EmbeddingRequest, ids: list[int], where: str) -> list[int]:
        """`ids` truncated as `truncate_prompt_tokens` says; 400 naming `where` when empty or over max_model_len."""
        ids = self.truncate_prompt(request, ids)
        param = where.split("[")[0]
        if not ids:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, f"{where} is empty: at least 1 token is needed",
                              param=param, code="invalid_value")
        if len(ids) > self.max_model_len:
            raise self._too_long(where, str(len(ids)))
        return ids

    def _render(self, request: EmbeddingRequest) -> list[int]:
        """The token ids of `request.messages` rendered by the chat endpoint's template path (its checks and 400s,
        a request's own chat_template trusted only with --trust-request-chat-template)."""
        if self.chat is None:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, "messages are not supported by this server; send input",
                              param="messages", code="invalid_value")
        chat_request = template_request(
            messages=request.messages, add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message, chat_template=request.chat_template,
            chat_template_kwargs=request.chat_template_kwargs, add_special_tokens=bool(request.add_special_tokens),
            truncate_prompt_tokens=request.truncate_prompt_tokens)
        try:
            return self.chat.apply_chat_template(chat_request)
        except OpenAIError as e:  # the chat endpoint's "no room for the completion" wording: an embedding's instead
            if e.code == "context_length_exceeded":
                raise self._too_long("messages", f"more than {self.max_model_len}") from None
            raise

    def _encode(self, request: EmbeddingRequest, text: str, where: str) -> list[int]:
        """`text`'s token ids; a very long one proven over max_model_len refused early (`encode_bounded`), unless
        truncate_prompt_tokens keeps its tail."""
        add = request.add_special_tokens is not False
        if request.truncate_prompt_tokens is not None:
            return list(self.tokenizer.encode(text, add_special_tokens=add))
        try:
            return encode_bounded(self.tokenizer, text, self.max_model_len, add_special_tokens=add)
        except PromptTooLong as e:
            raise self._too_long(where, f"more than {e.at_least}") from None

    def _too_long(self, where: str, count: str) -> OpenAIError:
        return OpenAIError(HTTPStatus.BAD_REQUEST, f"{where} has {count} tokens, more than this model's maximum "
                           f"context length {self.max_model_len}; shorten it", param=where.split("[")[0],
                           code="context_length_exceeded")


def _check_input_or_messages(request: EmbeddingRequest) -> None:
    """400 unless exactly one of input and messages is given, or for a messages-only field sent with input."""
    if request.input is not None and request.messages is not None:
        raise OpenAIError(HTTPStatus.BAD_REQUEST, "give either input or messages, not both", param="messages",
                          code="invalid_value")
    if request.input is None and request.messages is None:
        raise OpenAIError(HTTPStatus.BAD_REQUEST, "input is required: a string, a list of strings, a list of token "
                          "ids or a list of such lists (or chat messages, as messages)", param="input",
                          code="invalid_value")
    extra = [name for name in _CHAT_ONLY if name in request.model_fields_set] if request.input is not None else []
    if extra:
        raise OpenAIError(HTTPStatus.BAD_REQUEST, f"{extra[0]} applies to messages only; this request gives input",
                          param=extra[0], code="invalid_value")
