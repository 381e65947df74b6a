"""Pydantic models of OpenAI's Responses API (POST /v1/responses): the request and the response object.

The request is served on the chat path (`ResponsesRequest.to_chat_request`): `instructions` becomes a system
message, `input` (a string, or a list of message / function_call / function_call_output / reasoning items) the
chat messages, `max_output_tokens` max_tokens, the flat function tools chat's nested ones, `text.format` a
response_format. vLLM's extra sampling fields that its Responses request takes (top_k, seed, stop, ...) are passed
to the chat request as they are, so they are validated (and named in a 400) as there. As vLLM without its
response store (VLLM_ENABLE_RESPONSES_API_STORE), nothing is stored: `store` is accepted and ignored,
`previous_response_id` is refused (`serving_responses`), `background` is a 400.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StrictBool, ValidationError, model_validator

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.engine.chat import check_function_name, text_parts
from fxrewrite.runtime.server.protocol import (UNSUPPORTED_FIELDS, ChatCompletionRequest, OpenAIBaseModel,
                                               RequestInt, RequestModel, random_id)
from fxrewrite.runtime.server.validation_errors import FieldError, describe_errors

PASSED_TO_CHAT = ("top_k", "min_p", "seed", "stop", "repetition_penalty", "ignore_eos", "logit_bias",
                  "skip_special_tokens", "include_stop_str_in_output", "structured_outputs", "cache_salt",
                  "request_id", "presence_penalty", "frequency_penalty", "min_tokens", "stop_token_ids",
                  *UNSUPPORTED_FIELDS)
"""Fields outside OpenAI's Responses API that a request may carry (vLLM's sampling extras, and the fields the
server refuses any but the "off" value of): given to the chat request as they are, which checks them."""
logger = logging.getLogger(__name__)


def new_id(prefix: str) -> str:
    """An OpenAI Responses id such as "resp_3f2a..." (prefix, "_", 32 hex digits)."""
    return random_id(prefix).replace("-", "_", 1)


class FunctionTool(OpenAIBaseModel):
    """A Responses function tool: flat, {type, name, description, parameters, strict} (chat nests all but type
    under `function`). Other tool types (web_search, file_search, mcp, ...) need tools this server does not run."""

    type: Literal["function"]
    name: Annotated[str, AfterValidator(check_function_name)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class FunctionToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIBaseModel):
    """`text.format`: plain text, any JSON object, or JSON following `schema`."""

    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _check_schema(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format of type json_schema needs a schema")
        return self


class TextConfig(OpenAIBaseModel):
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))


class Reasoning(OpenAIBaseModel):
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    """Given to the chat template as `reasoning_effort` (as vLLM does); templates that do not read it ignore it."""
    summary: str | None = None


ResponseIncludable = Literal["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                             "message.input_image.image_url", "computer_call_output.output.image_url",
                             "code_interpreter_call.outputs", "reasoning.encrypted_content",
                             "message.output_text.logprobs"]
"""OpenAI's (and vLLM's) `include` values: another is a 400 naming it (a misspelt logprobs include gave no logprobs,
silently). Only message.output_text.logprobs does something here; the others name outputs this server has none of."""


class ResponsesRequest(RequestModel):
    """POST /v1/responses: OpenAI's fields this server serves (see the module docstring)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: RequestInt | None = Field(None, ge=1)
    temperature: Any = None  # checked as chat's (`to_chat_request`)
    top_p: Any = None
    stream: StrictBool = False
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "auto"
    parallel_tool_calls: StrictBool = True
    text: TextConfig = Field(default_factory=TextConfig)
    reasoning: Reasoning | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool = True  # accepted; nothing is stored (vLLM's default)
    background: StrictBool = False
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    service_tier: str = "auto"
    include: list[ResponseIncludable] | None = None  # "message.output_text.logprobs": the output_text's logprobs
    top_logprobs: RequestInt | None = None  # with that include: the alternatives per token (chat's check)
    prompt: Any = None  # OpenAI's stored prompt template (by id): refused, as vLLM refuses it

    def model_post_init(self, context: Any, /) -> None:
        ignored = sorted(set(self.model_extra or ()) - set(PASSED_TO_CHAT))  # the chat request warns of its own
        if ignored:
            logger.warning("ResponsesRequest: fields %s are not supported and were ignored", ignored)

    @model_validator(mode="after")
    def _check_input(self):
        if self.background:  # vLLM's words without its store
            raise FieldError("background", "This server does not support `store=True` and therefore does not "
                             "support the background mode (vLLM needs VLLM_ENABLE_RESPONSES_API_STORE=1 for it)")
        if self.prompt is not None:  # answering without the template's text would answer another prompt
            raise FieldError("prompt", "prompt templates are not supported (as in vLLM): send the prompt's text as "
                             "instructions and input")
        if self.input == "" or self.input == []:
            raise FieldError("input", "input must not be empty")
        return self

    def input_messages(self, fold_developer: bool = False) -> list[dict[str, Any]]:
        """The chat messages of `instructions` and `input` (FieldError naming input[i] for an item it cannot
        take): a function_call joins the assistant message before it (as its tool_calls), a function_call_output
        is a tool message, a reasoning item the assistant turn's reasoning. `fold_developer` (a chat template
        that has no developer role): as vLLM, developer messages are system ones and every system text joins one
        leading system message (most templates drop an unknown role silently, or take one system message, first)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        messages = self._item_messages(messages)
        return _folded_system(messages) if fold_developer else messages

    def _item_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`messages` followed by those of the input items (see `input_messages`)."""
        for i, item in enumerate(self.input):
            message = _item_message(item, f"input[{i}]")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and message["role"] == "assistant":
                if _merge_assistant(last, message):
                    continue
            messages.append(message)
        for message in messages:  # a turn of reasoning alone: chat templates read message['content']
            if message["role"] == "assistant" and message["content"] is None and not message.get("tool_calls"):
                message["content"] = ""
        return messages

    def continues_final_message(self) -> bool:
        """vLLM's partial completion: the last item is an assistant message still in progress (or incomplete),
        which the reply continues instead of starting a new turn."""
        last = self.input[-1] if isinstance(self.input, list) else None
        return (isinstance(last, dict) and last.get("type", "message") == "message"
                and last.get("role") == "assistant" and last.get("status") in ("in_progress", "incomplete"))

    def to_chat_request(self, fold_developer: bool = False) -> ChatCompletionRequest:
        """The chat request that serves this one; FieldError (a 400 naming this request's field) for a value
        chat refuses. `fold_developer`: as `input_messages`."""
        data: dict[str, Any] = {"model": self.model, "messages": self.input_messages(fold_developer),
                                "stream": self.stream,
                                "parallel_tool_calls": self.parallel_tool_calls, "user": self.user}
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            data["max_tokens"] = self.max_output_tokens
        if self.tools:
            data["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        choice = self.tool_choice
        data["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
        fmt = self.text.format
        if fmt.type == "json_object":
            data["response_format"] = {"type": "json_object"}
        elif fmt.type == "json_schema":
            data["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
                exclude={"type"}, exclude_none=True, by_alias=True)}
        if self.reasoning is not None and self.reasoning.effort is not None:
            data["chat_template_kwargs"] = {"reasoning_effort": self.reasoning.effort}
        if self.continues_final_message():
            data.update(add_generation_prompt=False, continue_final_message=True)
        if "message.output_text.logprobs" in (self.include or ()):  # vLLM's rule: top_logprobs alone gives none
            data.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        data.update({k: v for k, v in (self.model_extra or {}).items() if k in PASSED_TO_CHAT})
        try:
            return ChatCompletionRequest.model_validate(data)
        except ValidationError as e:
            message, param = describe_errors(e.errors())
            raise FieldError(RESPONSES_FIELD.get(param, param or "input"), renamed(message)) from None


RESPONSES_FIELD = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                   "messages": "input", "response_format": "text", "chat_template_kwargs": "reasoning"}
"""Chat request fields and the Responses field that set them, for errors found on the chat path."""


def renamed(message: str) -> str:
    """A chat error's text in this request's words: max_tokens is max_output_tokens, response_format text.format, and
    a leading "messages: " (the whole conversation) input."""
    for chat, own in (("max_tokens", "max_output_tokens"), ("response_format", "text.format")):
        message = message.replace(chat, own)
    return "input: " + message[len("messages: "):] if message.startswith("messages: ") else message


def _text(content: Any, where: str) -> str:
    """A message's (or an output's) text: a string, or its text parts (input_text, output_text, ...) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError("input", f"{where}: expected a string or a list of text parts, got {content!r:.60}")
    try:
        return "\n".join(part["text"] for part in text_parts(content, where))
    except UserInputError as e:
        raise FieldError("input", str(e)) from None


def _field(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise FieldError("input", f"{where}.{key}: expected a string, got {value!r:.60}")
    return value


def _item_message(item: Any, where: str) -> dict[str, Any]:
    """The chat message of one input item (see `ResponsesRequest.input_messages`)."""
    if not isinstance(item, dict):
        raise FieldError("input", f"{where}: expected an object (an input item), got {item!r:.60}")
    kind = item.get("type", "message")
    if kind == "message":
        role = _field(item, "role", where)
        if role not in ("user", "assistant", "system", "developer"):
            raise FieldError("input", f"{where}.role: {role!r} is not one of 'user', 'assistant', 'system', "
                             "'developer'")
        return {"role": role, "content": _text(item.get("content"), where)}
    if kind == "function_call":
        call = {"id": _field(item, "call_id", where), "type": "function", "function": {
            "name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": _field(item, "call_id", where),
                "content": _text(item.get("output"), f"{where}.output")}
    if kind == "reasoning":  # its reasoning_text parts (or, without them, its summary_text parts)
        parts = item.get("content") or item.get("summary") or []
        texts = [p.get("text") if isinstance(p, dict) else None for p in parts] if isinstance(parts, list) else [None]
        if not all(isinstance(t, str) for t in texts):  # a non-list (5, "flat") or a part without a string text
            raise FieldError("input", f"{where}.content: expected a list of reasoning_text parts ({{'type': "
                             f"'reasoning_text', 'text': ...}}), got {parts!r:.60}")
        return {"role": "assistant", "content": None, "reasoning": "\n".join(texts)}
    raise FieldError("input", f"{where}.type: {kind!r} is not supported (expected 'message', 'function_call', "
                     "'function_call_output' or 'reasoning')")


def _folded_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with every system and developer message's text joined (blank-line separated, in order) into one
    leading system message (vLLM's Responses API normalisation for chat templates without a developer role)."""
    system = [m["content"] for m in messages if m["role"] in ("system", "developer")]
    rest = [m for m in messages if m["role"] not in ("system", "developer")]
    return [{"role": "system", "content": "\n\n".join(system)}, *rest] if system else rest


def _merge_assistant(last: dict[str, Any], message: dict[str, Any]) -> bool:
    """Fold `message` (an assistant item: text, calls or reasoning) into the assistant message `last` when it adds
    what `last` lacks (vLLM's rule: one turn may span a reasoning item, a message and calls); False otherwise."""
    if message.get("tool_calls"):
        last["tool_calls"] = [*last.get("tool_calls", []), *message["tool_calls"]]
        return True
    if "reasoning" in message:
        if last.get("reasoning") is not None:
            return False
        last["reasoning"] = message["reasoning"]
        return True
    if last.get("content") is not None:
        return False
    last["content"] = message["content"]
    return True


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    """With include ["message.output_text.logprobs"]: per output token {token, logprob, bytes, top_logprobs}."""


class OutputMessage(OpenAIBaseModel):
    """An assistant message item of `output` (its text in one output_text part)."""

    id: str = Field(default_factory=lambda: new_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(OpenAIBaseModel):
    """A tool call item of `output`: `call_id` is what the function_call_output item sent back names."""

    id: str = Field(default_factory=lambda: new_id("fc"))
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    """JSON text."""
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(OpenAIBaseModel):
    """The think block (--reasoning-parser) as a reasoning item: its text in `content`, `summary` empty (vLLM's)."""

    id: str = Field(default_factory=lambda: new_id("rs"))
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0
    """Input tokens read from the prefix cache."""


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0
    """Output tokens inside the think block (0 without --reasoning-parser)."""


class ResponsesUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponsesResponse(OpenAIBaseModel):
    """The response object (also inside the stream's response.created / in_progress / completed events).

    status: "in_progress" (a stream's first events), "completed", or "incomplete" (cut by max_output_tokens,
    `incomplete_details.reason`). temperature, top_p, max_output_tokens: the values the request ran with."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponsesUsage | None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    max_output_tokens: int
    tool_choice: Any
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    background: bool = False
    service_tier: str = "auto"
    top_logprobs: int | None = None
    """The alternatives per token the output_text's logprobs carry (vLLM's: None without the logprobs include)."""
    truncation: str = "disabled"
    user: str | None = None
