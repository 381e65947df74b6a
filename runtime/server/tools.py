"""Tool calling on chat completions: what `tools` + `tool_choice` ask of the engine and how its text
becomes OpenAI `tool_calls`.

- `none`: the tools are still shown to the template (vLLM's default; a template that cannot show them renders
  without them); the answer is plain content.
- `auto`: the model decides; its own format is parsed (`tool_parsers`). Needs `--enable-auto-tool-choice`
  (and `--tool-call-parser`, "auto" by default here: picked by the chat template), as in vLLM.
- `required` / a named function: the output is forced with structured outputs, as vLLM does: a JSON
  list of {"name", "parameters"} objects whose names are the tools' (required), or the named function's
  arguments object (named), with no free whitespace (the grammar's separators are ", " and ": "; a model
  cannot wander into whitespace until max_tokens). Such output is always a valid call.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from fxrewrite.runtime.engine.json_schema_check import unenforced_keyword
from fxrewrite.runtime.engine.structured_outputs import StructuredOutputsParams
from fxrewrite.runtime.server.errors import OpenAIError
from fxrewrite.runtime.server.protocol import ChatCompletionRequest, FunctionCall, ToolCall
from fxrewrite.runtime.server.tool_parsers import ParsedToolCall, ToolParser, dump_arguments


def tool_mode(request: ChatCompletionRequest) -> str:
    """"none", "auto", "required" or "named". "none" without tools, as vLLM parses calls only when the request
    has tools: an explicit "auto" without them (the Responses API's default) is plain text."""
    choice = request.tool_choice
    if not request.tools:
        return "none"
    return choice if isinstance(choice, str) else "named"


def check_template_renders_tools(chat_template: str | None) -> None:
    """400 when the chat template never reads `tools` (transformers would silently drop them)."""
    if not chat_template or "tools" not in chat_template:
        raise OpenAIError(HTTPStatus.BAD_REQUEST, "this model's chat template cannot render tools (it never "
                          "reads `tools`); start the server with --chat-template pointing to a template that "
                          "does, or send the request without tools", param="tools", code="tools_unsupported")


def _parameters(tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _check_enforced(tools) -> None:
    """400 naming the tool and the place in its own parameters of a schema keyword the grammar would not enforce
    (the wrapped schema's path, /items/anyOf/0/properties/parameters/..., named nothing the user wrote)."""
    for i, tool in enumerate(tools):
        unenforced = unenforced_keyword(_parameters(tool))
        if unenforced:
            raise OpenAIError(HTTPStatus.BAD_REQUEST, f"tools[{i}].function.parameters ({tool.function.name!r}): "
                              f"{unenforced}; a forced tool call (tool_choice 'required' or named) cannot follow it",
                              param="tools", code="invalid_value")


def _hoist_defs(parameters: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each tool's parameters without their `$defs`, and those definitions gathered: a `#/$defs/X` reference
    points at the root of the schema it is written in, which is the list schema once the parameters are wrapped
    in it (vLLM hoists them the same way). 400 when two tools define one name differently."""
    stripped, defs = [], {}
    for params in parameters:
        own = params.get("$defs")
        if not isinstance(own, dict):  # none, or not a mapping: the schema compiler names what is wrong
            stripped.append(params)
            continue
        for name, schema in own.items():
            if defs.setdefault(name, schema) != schema:
                raise OpenAIError(HTTPStatus.BAD_REQUEST, f"tools define '$defs/{name}' differently; tool_choice "
                                  "'required' puts every tool's $defs in one schema", param="tools",
                                  code="invalid_value")
        stripped.append({k: v for k, v in params.items() if k != "$defs"})
    return stripped, defs


def forced_tool_outputs(request: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The constraint that forces a valid call for tool_choice required / named (None otherwise)."""
    mode = tool_mode(request)
    if mode in ("named", "required"):
        _check_enforced(request.tools)
    if mode == "named":
        name = request.tool_choice.function.name
        tool = next(t for t in request.tools if t.function.name == name)
        return StructuredOutputsParams(json=_parameters(tool), disable_any_whitespace=True)
    if mode != "required":
        return None
    parameters, defs = _hoist_defs([_parameters(t) for t in request.tools])
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                               "parameters": p},
              "required": ["name", "parameters"]} for t, p in zip(request.tools, parameters)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if defs:
        schema["$defs"] = defs
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def to_tool_calls(calls: list[ParsedToolCall]) -> list[ToolCall]:
    return [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


def parse_output(request: ChatCompletionRequest, text: str, parser: ToolParser | None
                 ) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished choice's text under the request's tool_choice."""
    mode = tool_mode(request)
    if mode == "named":
        return None, to_tool_calls([ParsedToolCall(request.tool_choice.function.name, text)])
    if mode == "required":
        try:
            objs = json.loads(text)
            calls = [ParsedToolCall(o["name"], dump_arguments(o["parameters"])) for o in objs]
        # cut short by max_tokens, or nested too deeply for json (a recursive schema): keep the text
        except (ValueError, KeyError, TypeError, RecursionError):
            return text, []
        return None, to_tool_calls(calls)
    if mode == "auto" and parser is not None:
        content, calls = parser.parse(text)
        if request.parallel_tool_calls is False:  # as vLLM: the model's first call only
            calls = calls[:1]
        return content, to_tool_calls(calls)
    return text, []


def finish_reason(request: ChatCompletionRequest, reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI reports "tool_calls" when the model chose to call (auto, required); a forced named call
    ends with "stop"."""
    if calls and reason == "stop" and tool_mode(request) in ("auto", "required"):
        return "tool_calls"
    return reason
