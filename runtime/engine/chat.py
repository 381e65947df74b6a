"""Chat messages to a prompt: the checks and the template rendering that `LLM.chat` and the server's
/v1/chat/completions share."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jinja2

from fxrewrite.errors import UserInputError


class ChatTemplateError(UserInputError):
    """The chat template itself failed while rendering (a jinja2 error, or its ``raise_exception(...)``)."""

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""The roles OpenAI's Chat Completions API accepts (any other is a 400 there)."""


def check_role(role: object, where: str | None = "message") -> str:
    """`role` if it is one of `CHAT_ROLES`; UserInputError naming it and the accepted roles otherwise,
    after `where` (None: no prefix, when the caller's error already says where, as pydantic's loc does)."""
    if role not in CHAT_ROLES:
        prefix = f"{where}: " if where else ""
        raise UserInputError(f"{prefix}role {role!r} is not one of {', '.join(map(repr, CHAT_ROLES))}")
    return role


FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""OpenAI's rule for a tool's function name (its API answers 400 for any other)."""


def check_function_name(name: str) -> str:
    """`name` if it follows `FUNCTION_NAME`; UserInputError naming it otherwise."""
    if not FUNCTION_NAME.fullmatch(name):
        raise UserInputError(f"function name {name!r} must be 1 to 64 letters, digits, '_' or '-' (OpenAI's rule)")
    return name


TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
"""Content part types that carry text, and the key holding it: OpenAI's text and refusal parts (an assistant turn
replayed from OpenAI's API may hold ``{"type": "refusal", "refusal": ...}``) and the Responses API's
input_text / output_text, all of which vLLM's chat parsing reads as text."""


def text_parts(content: list, where: str) -> list[dict]:
    """A message's list of OpenAI content parts as ``{"type": "text", "text": str}`` dicts (see
    `TEXT_PART_KEYS` for the part types taken as text). UserInputError naming ``where`` for an empty list, a
    part that is not text (images, audio: the engine serves text only) or a part whose text is not a string."""
    if not content:
        raise UserInputError(f"{where}.content is an empty list; expected a string or text parts "
                             "([{'type': 'text', 'text': ...}])")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = TEXT_PART_KEYS.get(kind) if isinstance(kind, str) else None
        if key is None:
            got = f"type {kind!r}" if isinstance(part, dict) else f"{part!r:.80}"
            raise UserInputError(f"{where}.content[{j}]: only text content parts ({{'type': 'text', 'text': ...}}; "
                                 f"also 'input_text', 'output_text' and 'refusal') are supported, got {got}")
        if not isinstance(part.get(key), str):
            raise UserInputError(f"{where}.content[{j}].{key} must be a string, got {part.get(key)!r:.80}")
        parts.append({"type": "text", "text": part[key]})
    return parts


def join_text_parts(content: object, where: str) -> object:
    """A message's content as chat templates read it: a list of OpenAI content parts (`text_parts`) joined
    with newlines, as vLLM joins them; anything else as it is. UserInputError as `text_parts` raises it."""
    if not isinstance(content, list):
        return content
    return "\n".join(part["text"] for part in text_parts(content, where))


def as_content_format(content: object, content_format: str, where: str) -> object:
    """A message's content in vLLM's chat_template_content_format: "string", text parts joined (`join_text_parts`);
    "openai", a list of ``{"type": "text", "text": ...}`` parts (a string becomes one). None stays None."""
    if content_format != "openai" or content is None:
        return join_text_parts(content, where)
    return text_parts(content, where) if isinstance(content, list) else [{"type": "text", "text": content}]


def with_reasoning(message: dict) -> dict:
    """`message` with an assistant turn's reasoning (an earlier reply's, sent back) under both `reasoning` and
    `reasoning_content`, whichever it came as (Qwen3's template reads the second), as vLLM passes it; another
    role's reasoning is dropped, as vLLM drops it."""
    reasoning = message.get("reasoning")
    reasoning = message.get("reasoning_content") if reasoning is None else reasoning
    message = {k: v for k, v in message.items() if k not in ("reasoning", "reasoning_content")}
    if reasoning is not None and message.get("role") == "assistant":
        message["reasoning"] = message["reasoning_content"] = reasoning
    return message


def resolve_chat_template(value: str | None, name: str = "chat_template") -> str | None:
    """A chat template given as a file path or as its text: the value itself when it looks like a template
    (vLLM's rule: it holds "{", "}" or a newline), else the named file's text. UserInputError naming `name`
    and the value for a path that does not exist (a mistyped path must not become the prompt) or a template
    that Jinja cannot parse."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise UserInputError(f"{name}={value!r} must be a file path or the template text (a string)")
    if any(c in value for c in "{}\n"):
        template, source = value, "the template text"
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            raise UserInputError(f"{name} {value!r}: no such file (give a file path or the template text)")
        template, source = path.read_text(), str(path)
    check_template_syntax(template, f"{name} {value!r}", source)
    return template


def check_template_syntax(template: str, where: str, source: str = "the template text") -> None:
    """UserInputError "<where>: not a valid Jinja template (<source>, line N: ...)" when Jinja cannot
    parse `template` (compiled as transformers compiles chat templates)."""
    # transformers' own compile (its sandbox and extensions: {% generation %}, loop controls); heavy, so
    # imported only when a template is given
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template
    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as e:
        raise UserInputError(f"{where}: not a valid Jinja template ({source}, line {e.lineno}: {e.message})") from None


def check_generation_mode(messages: list, add_generation_prompt: bool, continue_final_message: bool) -> None:
    """vLLM's rule for `continue_final_message` (the last message is left open for the model to continue, e.g. a
    prefilled answer, or a user's unfinished text): it excludes `add_generation_prompt` (transformers refuses
    both). Any role may be continued, as in transformers and vLLM (whose reply then has that role).
    UserInputError naming the fields otherwise."""
    if continue_final_message and add_generation_prompt:
        raise UserInputError("continue_final_message and add_generation_prompt cannot both be true; set "
                             "add_generation_prompt to false to continue the last message")


RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "return_dict", "return_tensors",
                                      "chat_template", "tokenizer"})
"""Arguments of transformers' apply_chat_template that the renderer sets itself (the conversation, text
output); a request's own template goes in vLLM's `chat_template` field (the server checks it there)."""


def check_template_kwargs(chat_template_kwargs: dict | None) -> None:
    """UserInputError naming the key when chat_template_kwargs sets one of `RESERVED_TEMPLATE_KWARGS`, or
    add_generation_prompt / continue_final_message to something other than a bool."""
    extra = chat_template_kwargs or {}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(extra))
    if reserved:
        raise UserInputError(f"chat_template_kwargs may not set {reserved}: the renderer sets "
                             f"{sorted(RESERVED_TEMPLATE_KWARGS)} itself")
    for name in ("add_generation_prompt", "continue_final_message"):
        if name in extra and not isinstance(extra[name], bool):
            raise UserInputError(f"chat_template_kwargs[{name!r}]={extra[name]!r} must be true or false")


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template reads `tools` at all (transformers would silently drop them otherwise)."""
    return bool(chat_template) and "tools" in chat_template


def render_chat(tokenizer, messages: list[dict], *, chat_template: str | None = None, tools: list | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: dict | None = None) -> str:
    """The prompt text of one conversation through the chat template (`chat_template`, else the
    tokenizer's), as vLLM renders it for LLM.chat and /v1/chat/completions: `tools` (OpenAI tool dicts)
    are given to the template; `continue_final_message` leaves the last message open (no end-of-turn
    token, no generation prompt). `chat_template_kwargs` are extra template variables; as in vLLM they
    override the named arguments (`add_generation_prompt`, `continue_final_message`, `tools`), and the keys
    `RESERVED_TEMPLATE_KWARGS` are refused. UserInputError for a bad combination, a reserved key or a
    template that cannot render the tools; ChatTemplateError (a UserInputError) when the template itself
    fails (a jinja2 error, its raise_exception, or any error its code raises, such as a TypeError)."""
    check_template_kwargs(chat_template_kwargs)
    extra = dict(chat_template_kwargs or {})
    add_generation_prompt = extra.pop("add_generation_prompt", add_generation_prompt)
    continue_final_message = extra.pop("continue_final_message", continue_final_message)
    tools = extra.pop("tools", tools)
    check_generation_mode(messages, add_generation_prompt, continue_final_message)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template is None:
        raise UserInputError("the tokenizer has no chat template; pass chat_template (a Jinja template)")
    if tools and not template_renders_tools(template):
        raise UserInputError("this model's chat template cannot render tools (it never reads `tools`); pass "
                             "a chat_template that does, or leave tools out")
    messages = tool_call_arguments_as_dicts(messages)
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, **extra)
    except jinja2.TemplateError as e:  # a syntax error, or the template's own raise_exception(...)
        raise ChatTemplateError(f"chat template failed: {e}") from e
    except UserInputError:
        raise
    except Exception as e:  # noqa: BLE001 - what the template's own code raised (vLLM: a ValueError of it too)
        # e.g. `message['content'] + '...'` on list content (chat_template_content_format="openai"): a TypeError
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


def tool_call_arguments_as_dicts(messages: list[dict]) -> list[dict]:
    """`messages` with each assistant tool call's `function.arguments` (OpenAI's JSON string) parsed into a dict,
    an empty or missing one as {}, as vLLM gives them to the template (transformers' convention: templates such
    as Llama 3.1's write `arguments | tojson`, which a string would reach double-encoded; Qwen's printed an empty
    string as `"arguments": }`). The caller's dicts are not changed. UserInputError naming the message and call
    when a string is not JSON (vLLM: a 400 from json.loads). The server's messages come parsed already
    (`protocol._template_tool_call`); LLM.chat's rendered the string as it was."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not isinstance(calls, list) or not calls or message.get("role") != "assistant":
            out.append(message)
            continue
        parsed = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or isinstance(function.get("arguments"), (dict, list)):
                parsed.append(call)
                continue
            arguments = function.get("arguments") or {}
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; deep nesting recurses
                    raise UserInputError(f"message {i} tool_calls[{j}].function.arguments={arguments!r:.80} is not "
                                         f"JSON ({e})") from None
            parsed.append({**call, "function": {**function, "arguments": arguments}})
        out.append({**message, "tool_calls": parsed})
    return out
