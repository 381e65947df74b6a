"""One clear sentence for a request pydantic refused: the field, what it expects, what it got.

pydantic reports a union field (`stop: str | list[str]`) as one error per member, each under a member
tag (`stop.str`, `stop.list[str]`); shown raw that reads "stop.str: Input should be a valid string".
Here the member tags leave the path, and the members become the expectation:
"stop: expected a string or a list of strings, got 5 (a number)". When one member got further than the
others (the input had its shape, something inside was wrong), that member's own error is the answer.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

_SIMPLE = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
           "dict": "an object", "list": "a list", "none": "null", "any": "any value"}
_PLURAL = {"str": "strings", "int": "integers", "float": "numbers", "bool": "booleans", "dict": "objects"}
_EXPECTED = {"int_parsing": "an integer", "int_type": "an integer", "int_from_float": "an integer",
             "float_parsing": "a number", "float_type": "a number", "string_type": "a string",
             "list_type": "a list", "dict_type": "an object", "model_type": "an object",
             "model_attributes_type": "an object", "bool_parsing": "true or false", "bool_type": "true or false"}
_JSON_TYPE = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
              dict: "an object", type(None): "null"}


def _is_member_tag(part: Any) -> bool:
    """A union member's tag in a pydantic loc: `str`, `list[int]`, `literal['a','b']`, `ModelName`,
    `function-after[...]`: not a JSON field name (those are lower-case identifiers) nor an index."""
    if not isinstance(part, str):
        return False
    return part in _SIMPLE or "[" in part or "-" in part or part[:1].isupper()


def _unwrap(tag: str) -> str:
    """The type a validator wraps: `function-before[_whole_number(), int]` -> `int` (other tags as they are)."""
    match = re.fullmatch(r"function-\w+\[[\w.]+\(\), (.*)\]", tag)
    return _unwrap(match.group(1)) if match else tag


def _plural(tag: str) -> str:
    tag = _unwrap(tag)
    if tag in _PLURAL:
        return _PLURAL[tag]
    if tag[:1].isupper() or tag.startswith(("dict[", "typed-dict")):
        return "objects"
    if tag.startswith("list["):
        return "lists of " + _plural(tag[5:-1])
    return f"{_describe_tag(tag)} values"


def _describe_tag(tag: str) -> str:
    """English for a member tag: list[str] -> "a list of strings", literal['a','b'] -> "'a' or 'b'"."""
    tag = _unwrap(tag)
    if tag in _SIMPLE:
        return _SIMPLE[tag]
    if tag.startswith("list[") and tag.endswith("]"):
        return "a list of " + _plural(tag[5:-1])
    if tag.startswith(("dict[", "typed-dict")) or tag[:1].isupper():  # a model class: its name is ours
        return "an object"
    if tag.startswith("literal[") and tag.endswith("]"):
        return ", ".join(tag[8:-1].split(","))
    return re.sub(r"^\w+-\w+\[(.*)\]$", r"\1", tag)  # another wrapper (function-plain[f()]): its inside


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({_JSON_TYPE.get(type(value), type(value).__name__)})"


class FieldError(ValueError):
    """A request-level validator's error about one top-level field: `param` is that field, so the 400
    names it (a model validator's own errors have no field in their pydantic `loc`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _split(loc: tuple) -> tuple[list, str | None, list]:
    """(field path before the first member tag, that tag, the path after it with later tags dropped); names are
    strings, list indices ints (`_where`)."""
    parts = [part for part in loc if part != "body"]
    for i, part in enumerate(parts):
        if _is_member_tag(part):
            return parts[:i], part, [p for p in parts[i + 1:] if not _is_member_tag(p)]
    return parts, None, []


def _where(path: list) -> str:
    """A field path as OpenAI's `param` writes one: ``messages[0].content``, not pydantic's ``messages.0.content``."""
    return "".join(f"[{p}]" if isinstance(p, int) else f"{'.' if n else ''}{p}" for n, p in enumerate(path))


def _message(error: dict) -> str:
    """pydantic's "Input should be a valid integer, unable to parse ..." as "expected an integer"."""
    if error.get("type") in _EXPECTED:
        return "expected " + _EXPECTED[error["type"]]
    if error.get("type") == "missing":
        return "field required"
    if error.get("type") in ("too_short", "too_long"):  # a list / tuple with too few or too many items
        ctx = error.get("ctx") or {}
        bound, n = (("at least", ctx.get("min_length")) if error["type"] == "too_short"
                    else ("at most", ctx.get("max_length")))
        return f"expected {bound} {n} item{'' if n == 1 else 's'}"
    value = error.get("input")
    if isinstance(value, float) and not math.isfinite(value):  # NaN is not "more than 2": it is no number
        return "expected a finite number"
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    if not message.startswith("Input should be "):
        return message
    wanted = message.removeprefix("Input should be ")
    return "expected " + ("a value " if wanted.startswith(("greater", "less")) else "") + wanted


def _got(error: dict) -> str:
    """", got 5 (a number)"; nothing for a missing field or a validator's own message (it names the value)."""
    shown = "input" in error and error.get("type") not in ("missing", "value_error", "assertion_error")
    return f", got {_shown(error['input'])}" if shown else ""


def describe_errors(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for pydantic's `errors()` of one request (loc starting with "body" or not);
    param is the top-level field at fault."""
    first = errors[0]
    path, tag, _ = _split(first.get("loc", ()))
    param = path[0] if path else None
    cause = (first.get("ctx") or {}).get("error")
    if param is None and isinstance(cause, FieldError):
        return _message(first) + _more(errors, path), cause.param
    if tag is None:
        where = _where(path)
        message = _message(first) + _got(first)
        named = not where or message.startswith((f"{where}:", f"{where} "))  # a validator may name it
        return (message if named else f"{where}: {message}") + _more(errors, path), param
    members = [(e, *_split(e.get("loc", ()))) for e in errors]
    members = [(e, t, rest) for e, p, t, rest in members if p == path and t is not None]
    deepest = max(len(rest) for _, _, rest in members)
    deep = [m for m in members if len(m[2]) == deepest]
    if deepest and len({t for _, t, _ in deep}) == 1:  # the input had that member's shape
        error, _, rest = deep[0]
        where = _where(path + rest)
        return f"{where}: {_message(error)}{_got(error)}{_more(errors, path)}", param
    expected = list(dict.fromkeys(_describe_tag(t) for _, t, _ in members))
    wanted = expected[0] if len(expected) == 1 else ", ".join(expected[:-1]) + " or " + expected[-1]
    return f"{_where(path)}: expected {wanted}, got {_shown(first.get('input'))}{_more(errors, path)}", param


def _more(errors: list[dict], path: list[str]) -> str:
    """" (and 2 more problem(s))" for the errors about other fields than `path`."""
    others = {tuple(_split(e.get("loc", ()))[0]) for e in errors} - {tuple(path)}
    return f" (and {len(others)} more problem(s))" if others else ""
