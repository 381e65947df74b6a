"""Pydantic models of the OpenAI requests the server takes (completions, chat, tools); responses are in protocol_responses.

Field names, types and defaults are OpenAI's, plus vLLM's sampling extras (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens). Sampling fields default to None so that the model's
generation_config.json can supply a default before the usual one (temperature 1.0, top_p 1.0, ...).
A value out of range fails validation, which the server answers with a 400 in OpenAI's error shape.
"""

from __future__ import annotations

import collections
import json
import re
import typing
import logging
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)

from fxrewrite.errors import UserInputError, check_unicode
from fxrewrite.runtime.engine.chat import check_function_name, check_role, join_text_parts, with_reasoning
from fxrewrite.runtime.engine_config import SEED_RANGE
from fxrewrite.runtime.server.validation_errors import FieldError

# A logit_bias key that int() reads: ASCII digits (str.isdigit() also takes "¹" or "①", which int() refuses), an
# optional "-" (then refused as negative); at most 20 significant digits (no token id has more), so int() never
# meets Python's 4300-digit limit.
_INTEGER_KEY = re.compile(r"-?0*[0-9]{1,20}")

# torch.Generator.manual_seed takes a 64-bit integer.
_SEED_RANGE = {"ge": SEED_RANGE[0], "le": SEED_RANGE[1]}

UNSUPPORTED_FIELDS = {"functions": [], "suffix": "", "logits_processors": [], "use_beam_search": False, "priority": 0}
"""Request fields this server does not implement: {name: the one value accepted (the field's "off")}; any other
value is a 400 naming the field (vLLM's `priority` needs its priority scheduling, which this engine lacks)."""


def random_id(prefix: str) -> str:
    """An id such as "cmpl-3f2a..." (prefix + 32 hex digits)."""
    return f"{prefix}-{uuid.uuid4().hex}"


logger = logging.getLogger(__name__)
HANDLED_EXTRAS = {"guided_whitespace_pattern", "documents", "request_id", "cache_salt"}  # model_extra (request_params, serving_*)


def _whole_number(value: Any) -> Any:
    """A float with no fractional part as an int (2.0 -> 2), as vLLM's lax pydantic models take it; any other
    value as it is, for StrictInt to judge (2.5, "2", true, Infinity and 1e308, past any int64 field, stay "expected
    an integer": the last was echoed as a 309-digit number)."""
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2.0**63 else value


RequestInt = Annotated[StrictInt, BeforeValidator(_whole_number)]
"""An integer request field: an int, or a float such as 2.0 that is one (a string or a boolean is refused)."""

TokenId = Annotated[RequestInt, Field(ge=0)]
"""A token id in a request (the vocabulary bound is checked against the model when the request arrives)."""


def _check_strings(value: Any, path: str) -> None:
    """`check_unicode` on every string in a request's JSON (lone surrogates pass JSON and pydantic, then no
    tokenizer can encode them); FieldError naming the top-level field."""
    if isinstance(value, str):
        try:
            check_unicode(value, path)
        except UserInputError as e:
            raise FieldError(path.split(".", 1)[0].split("[", 1)[0], str(e)) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_strings(item, f"{path}[{i}]")


class OpenAIBaseModel(BaseModel):
    # Unknown fields are accepted and ignored, as OpenAI and vLLM do (clients send extras); like vLLM, the
    # server log names them, so a misspelt field ("max_token") is not silently without effect.
    model_config = ConfigDict(extra="allow")

    def model_post_init(self, context: Any, /) -> None:  # after validation; no validator in error texts
        ignored = sorted(set(self.model_extra or ()) - HANDLED_EXTRAS - set(UNSUPPORTED_FIELDS))
        if ignored:
            logger.warning("%s: fields %s are not supported and were ignored", type(self).__name__, ignored)


class RequestModel(OpenAIBaseModel):
    """A request body: every string in it must be valid Unicode (a 400 naming the field, not a tokenizer's
    TypeError); an explicit null for an optional field that has no null meaning of its own takes the field's
    default, as OpenAI's API and vLLM accept it (``"n": null`` is n=1; ``"max_tokens": null`` stays null)."""

    @model_validator(mode="before")
    @classmethod
    def _unicode_and_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_strings(data, "")
            fields = cls.model_fields
            nulls = [k for k, v in data.items() if v is None and k in fields and not fields[k].is_required()
                     and type(None) not in typing.get_args(fields[k].annotation)]
            if nulls:
                data = {k: v for k, v in data.items() if k not in nulls}
        return data


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class JsonSchemaFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON following `json_schema.schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


class SamplingRequest(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: RequestInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0.0, allow_inf_nan=False)  # the bound: SamplingParams (float32)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    n: RequestInt = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: RequestInt | None = Field(None, **_SEED_RANGE)
    presence_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: RequestInt | None = Field(None, ge=-1)
    min_p: StrictFloat | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: StrictFloat | None = Field(None, gt=0.0, allow_inf_nan=False)
    ignore_eos: StrictBool = False
    min_tokens: RequestInt = Field(0, ge=0)
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    best_of: RequestInt | None = Field(None, ge=1, le=128)
    logit_bias: dict[str, StrictFloat] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: RequestInt | None = Field(None, ge=-1)  # -1: the whole vocabulary (vLLM's)
    return_tokens_as_token_ids: StrictBool = False  # logprobs name tokens "token_id:<id>"
    truncate_prompt_tokens: RequestInt | None = Field(None, ge=-1)  # keep the prompt's last k tokens (-1: the context)
    # structured outputs: OpenAI's response_format, vLLM's guided_* fields and their new name
    response_format: ResponseFormat | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_common(self):
        for name, off in UNSUPPORTED_FIELDS.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and value != off:
                raise FieldError(name, f"{name}={value!r} is not supported by this server (only {off!r} is accepted)")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options can only be set when stream is true")
        limit = self.output_limit()
        if limit is not None and self.min_tokens > limit:
            raise FieldError("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({limit})")
        if (isinstance(self.stop, list) and any(not s for s in self.stop)) or self.stop == "":
            raise FieldError("stop", "stop strings must not be empty")
        if self.best_of is not None and self.best_of < self.n:
            raise FieldError("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of not in (None, 1) and self.stream:
            raise FieldError("best_of", "best_of cannot be used with stream")
        if self.prompt_logprobs is not None and self.stream:  # as vLLM's server: no chunk carries them
            raise FieldError("prompt_logprobs", "prompt_logprobs are not available when stream is true")
        for key, bias in (self.logit_bias or {}).items():
            if _INTEGER_KEY.fullmatch(key) is None or int(key) < 0:
                raise FieldError("logit_bias", f"logit_bias key {key!r} must be a token id (a non-negative integer)")
            if not -100 <= bias <= 100:
                raise FieldError("logit_bias", f"logit_bias value {bias} for token {key} must be in [-100, 100]")
        return self

    def output_limit(self) -> int | None:
        """The largest number of tokens to generate that the request asked for, or None."""
        return self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """Every chunk's `usage`: the prompt's tokens and its choice's tokens so far (vLLM's rule)."""
        return self.include_usage() and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or lists of token ids."""

    prompt: str | list[str] | list[RequestInt] | list[list[RequestInt]]
    max_tokens: RequestInt | None = Field(16, ge=0)  # OpenAI's default; 0 with echo returns the prompt alone
    logprobs: RequestInt | None = Field(None, ge=-1)  # the engine's max_logprobs (--max-logprobs) is the limit; -1 all
    echo: StrictBool = False
    add_special_tokens: StrictBool = True  # vLLM's: the tokenizer's BOS etc. around a text prompt

    @model_validator(mode="after")
    def _check_prompt(self):
        prompt = self.prompt
        if prompt == "" or prompt == []:
            raise FieldError("prompt", "prompt must not be empty")
        if isinstance(prompt, list) and any(isinstance(p, (str, list)) and len(p) == 0 for p in prompt):
            raise FieldError("prompt", "prompt must not contain an empty prompt")
        if self.max_tokens == 0 and (not self.echo or self.stream):
            raise FieldError("max_tokens", "max_tokens=0 needs echo=true and no stream (the prompt alone is returned)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, one per entry: strings or token-id lists."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None

    def model_post_init(self, context: Any, /) -> None:
        """No "ignored" warning: a part's other fields (image_url, input_audio...) belong to a part that is not
        text, which the request is then refused for (`join_text_parts`), not served without."""


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's shape)."""


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None  # a reply's reasoning sent back (vLLM's names; Qwen3's template reads
    reasoning_content: str | None = None  # message.reasoning_content): the template gets both (`with_reasoning`)

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:  # OpenAI answers 400 for any other role
        return check_role(role, None)  # the 400 names messages.<i>.role already

    def to_template_dict(self, where: str = "message") -> dict[str, Any]:
        """The message as chat templates expect it; text parts are joined, other parts refused (ValueError
        naming ``where``). Tool-call arguments become dicts (transformers' chat templates expect them so, as
        vLLM passes them), and an assistant turn's reasoning goes under both of vLLM's names."""
        message = with_reasoning(self.model_dump(exclude_none=True))
        if self.tool_calls:
            message["tool_calls"] = [_template_tool_call(c) for c in self.tool_calls]
            if self.content is None:
                message["content"] = ""
                return message
        if self.content is None:  # chat templates read message['content']: a jinja error otherwise
            raise ValueError(f"{where}: a message of role {self.role!r} needs a 'content' (a string or a list of "
                             "text parts)")
        if isinstance(self.content, list):
            message["content"] = join_text_parts([part.model_dump() for part in self.content], where)
        return message


def _template_tool_call(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments) if call.function.arguments else {}
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; too deep a nesting recurses
        raise ValueError(f"tool call {call.function.name!r}: arguments are not valid JSON ({e})") from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


class FunctionDefinition(OpenAIBaseModel):
    name: Annotated[str, AfterValidator(check_function_name)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    _server_role: str = "assistant"  # the reply's role after a generation prompt: serve's --response-role
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = None
    parallel_tool_calls: StrictBool | None = True

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: RequestInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: RequestInt | None = Field(None, ge=-1)  # as logprobs
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False  # vLLM's: the template writes BOS; True adds the tokenizer's on top
    continue_final_message: StrictBool = False  # vLLM's: leave the last (assistant) message open to continue it
    echo: StrictBool = False
    """vLLM's: the reply starts with the last message's text when that message is the assistant's (a continuation)."""
    chat_template: str | None = None
    """vLLM's: this request's chat template (text); used only with --trust-request-chat-template."""
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.tool_choice is None:  # OpenAI's default: auto with tools, none without
            self.tool_choice = "auto" if self.tools else "none"
        if self.tool_choice not in ("none", "auto") and not self.tools:
            raise FieldError("tool_choice", "tool_choice requires tools")
        names = [t.function.name for t in self.tools or ()]
        repeated = sorted(n for n, count in collections.Counter(names).items() if count > 1)
        if repeated:  # a call names its function: two tools of one name would make it ambiguous
            raise FieldError("tools", f"tools name the function{'s' if len(repeated) > 1 else ''} "
                             f"{', '.join(map(repr, repeated))} more than once; expected unique function names")
        if isinstance(self.tool_choice, ChatCompletionNamedToolChoiceParam):
            if self.tool_choice.function.name not in names:
                raise FieldError("tool_choice", f"tool_choice names the function {self.tool_choice.function.name!r}, "
                                 f"which is not in tools ({names})")
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def response_role(self) -> str:
        """The reply's role, as vLLM decides it: "assistant" after a generation prompt, else the last message's
        (a continued user message is answered as the user's text)."""
        return self._server_role if self.add_generation_prompt else self.messages[-1].role

    def echoed_text(self) -> str:
        """What `echo` puts before each choice's content: the last message's text when its role is the reply's
        (`response_role`, as vLLM decides), else ""."""
        last = self.messages[-1]
        if not self.echo or last.role != self.response_role() or last.content is None:
            return ""
        return last.to_template_dict("messages")["content"]
