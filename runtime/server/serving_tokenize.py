"""POST /v1/tokenize and /v1/detokenize (vLLM's endpoints and shapes).

/v1/tokenize takes a `prompt` (text, tokenized as /v1/completions does) or chat `messages` (rendered
by the chat template as /v1/chat/completions does, tools and a trusted request `chat_template` included) and answers
{"count", "max_model_len", "tokens", "token_strs"}; /v1/detokenize takes {"tokens"} and answers {"prompt"}.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from pydantic import Field, StrictBool, ValidationError, model_validator

from fxrewrite.runtime.server.errors import OpenAIError
from fxrewrite.runtime.server.protocol import (ChatCompletionRequest, ChatMessage, OpenAIBaseModel, RequestInt,
                                               RequestModel)
from fxrewrite.runtime.server.validation_errors import describe_errors


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None
    """Default True for a prompt; False for messages (the template writes them)."""
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[RequestInt] = Field(min_length=0)


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


async def tokenize(chat, request: TokenizeRequest) -> TokenizeResponse:
    """`chat`: the OpenAIServingChat (its tokenizer, template and checks are reused); the work runs in its
    tokenizer thread, off the event loop."""
    chat.model_name(request.model)
    return await chat.async_tokenizer.run(_tokenize, chat, request)


def _tokenize(chat, request: TokenizeRequest) -> TokenizeResponse:
    tokenizer = chat.tokenizer
    if request.prompt is not None:
        add = True if request.add_special_tokens is None else request.add_special_tokens
        ids = list(tokenizer.encode(request.prompt, add_special_tokens=add))
    else:
        ids = chat.apply_chat_template(template_request(
            messages=request.messages, add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message, chat_template=request.chat_template,
            chat_template_kwargs=request.chat_template_kwargs, tools=request.tools))
        if request.add_special_tokens and tokenizer.bos_token_id is not None and ids[:1] != [tokenizer.bos_token_id]:
            ids = [tokenizer.bos_token_id] + ids
    strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=chat.max_model_len, tokens=ids, token_strs=strs)


def template_request(**fields: Any) -> ChatCompletionRequest:
    """A chat request holding only what `OpenAIServingChat.apply_chat_template` reads (messages, add_generation_prompt,
    continue_final_message, chat_template, chat_template_kwargs, tools, add_special_tokens, truncate_prompt_tokens),
    for an endpoint that renders messages as /v1/chat/completions does (tokenize, embeddings). The chat endpoint's
    own checks (messages non-empty, tools' shape) are a 400 (`OpenAIError`) naming the field."""
    try:
        return ChatCompletionRequest(tool_choice="none", **fields)
    except ValidationError as e:
        message, param = describe_errors(e.errors())
        raise OpenAIError(HTTPStatus.BAD_REQUEST, message, param=param, code="invalid_value") from None


async def detokenize(chat, request: DetokenizeRequest) -> DetokenizeResponse:
    chat.model_name(request.model)
    chat.check_token_ids(request.tokens, "tokens")
    try:
        return DetokenizeResponse(prompt=await chat.async_tokenizer.decode(request.tokens))
    except Exception as e:  # noqa: BLE001 - a tokenizer that cannot decode these ids
        raise OpenAIError(HTTPStatus.BAD_REQUEST, f"tokens cannot be decoded: {e}", param="tokens",
                          code="invalid_value") from None
