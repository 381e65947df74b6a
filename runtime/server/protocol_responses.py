"""OpenAI response bodies (completions, chat completions, their stream chunks, models): what the server sends."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, model_serializer

from fxrewrite.runtime.server.protocol import OpenAIBaseModel, ToolCall, random_id


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int = 0
    """Prompt tokens read from the prefix cache instead of computed."""


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None
    """Only with serve's --enable-prompt-tokens-details, and only when some prompt tokens were cached (vLLM's
    rule); left out of the JSON otherwise."""

    @model_serializer(mode="wrap")
    def _without_empty_details(self, handler) -> dict[str, Any]:
        out = handler(self)
        if out.get("prompt_tokens_details") is None:
            out.pop("prompt_tokens_details", None)
        return out

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class ChoiceEnd(OpenAIBaseModel):
    """Why a choice stopped: OpenAI's finish_reason, and vLLM's stop_reason (the stop string or token id)."""

    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ResponseEnvelope(OpenAIBaseModel):
    """What every response and stream chunk carries around its choices."""

    id: str
    created: int
    model: str
    usage: UsageInfo | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(ChoiceEnd):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionResponse(ResponseEnvelope):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    choices: list[CompletionChoice]


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(OpenAIBaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None
    """The think block's text (--reasoning-parser); `reasoning_content` is vLLM's older name, the same text."""
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(ChoiceEnd):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None


class ChatCompletionResponse(ResponseEnvelope):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    choices: list[ChatChoice]


class DeltaModel(OpenAIBaseModel):
    """A part of a stream chunk's delta: fields with nothing to add are left out of the JSON, as OpenAI and vLLM
    send them (``{"content": " the"}``, not ``"role": null, "tool_calls": null`` beside it)."""

    @model_serializer(mode="wrap")
    def _without_nones(self, handler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(DeltaModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(DeltaModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(DeltaModel):
    """What a stream chunk adds to the message (see `DeltaModel`)."""

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(ChoiceEnd):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None


class ChatCompletionStreamResponse(ResponseEnvelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


class CompletionStreamResponse(ResponseEnvelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "fxrewrite"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
