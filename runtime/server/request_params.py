"""Request fields that map onto the engine's optional features: structured outputs (OpenAI's
`response_format`, vLLM's `guided_*` and `structured_outputs`), `best_of`, and prompt logprobs in vLLM's
JSON shape. Every user error is an `OpenAIError` (400) naming the field."""

from __future__ import annotations

import dataclasses
from http import HTTPStatus
from typing import Any

from fxrewrite.runtime.engine.structured_outputs import StructuredOutputsParams
from fxrewrite.runtime.server.errors import OpenAIError
from fxrewrite.runtime.server.protocol import SamplingRequest


def _bad(message: str, param: str) -> OpenAIError:
    return OpenAIError(HTTPStatus.BAD_REQUEST, message, param=param, code="invalid_value")


_OPTIONS = ("disable_any_whitespace",)
_CONSTRAINTS = tuple(f.name for f in dataclasses.fields(StructuredOutputsParams) if f.name not in _OPTIONS)
_KNOWN_KEYS = tuple(f.name for f in dataclasses.fields(StructuredOutputsParams))


def structured_outputs_of(request: SamplingRequest) -> StructuredOutputsParams | None:
    """The one output constraint a request sets, or None; 400 when it sets several or a bad one.
    A `structured_outputs` holding only options ({"disable_any_whitespace": true}) applies them to the
    constraint given by response_format or guided_*."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        found.append(("response_format", {"json": fmt.json_schema.schema_}))
    for field, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(request, field) is not None:
            found.append((field, {key: getattr(request, field)}))
    options = {}
    if request.structured_outputs is not None:
        given = dict(request.structured_outputs)
        unknown = sorted(set(given) - set(_KNOWN_KEYS))
        if unknown:
            raise _bad(f"structured_outputs: unknown key(s) {unknown}; expected one of {', '.join(_KNOWN_KEYS)}",
                       "structured_outputs")
        if set(given) <= set(_OPTIONS):  # only options: they apply to the constraint set elsewhere
            options = given
        else:
            found.append(("structured_outputs", given))
    if not found:
        if request.structured_outputs is not None:  # {} or options alone: nothing they could apply to
            raise _bad(f"structured_outputs: no output constraint given; set one of {', '.join(_CONSTRAINTS)} (or "
                       "response_format / guided_*)", "structured_outputs")
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise _bad(f"only one output constraint may be set, got {names}", found[1][0])
    field, kwargs = found[0]
    kwargs = {**options, **kwargs}
    if (request.model_extra or {}).get("guided_whitespace_pattern") is not None:
        raise _bad("guided_whitespace_pattern is not supported (use structured_outputs' "
                   "disable_any_whitespace)", "guided_whitespace_pattern")
    try:
        return StructuredOutputsParams(**kwargs)
    except (TypeError, ValueError) as e:
        raise _bad(f"{field}: {str(e).removeprefix('StructuredOutputsParams: ')}", field) from None


def request_cache_salt(request: SamplingRequest) -> str | None:
    """The request's ``cache_salt`` (vLLM's: its cached prefix is found only by requests with the same salt), else
    None; a 400 naming it unless it is a non-empty string."""
    salt = (request.model_extra or {}).get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise _bad(f"cache_salt must be a non-empty string, got {salt!r:.60}", "cache_salt")
    return salt


def structured_outputs_field(request: SamplingRequest) -> str:
    """The request field that set its output constraint (`response_format`, a `guided_*` field or
    `structured_outputs`); `tools` when none did (a chat request whose tool_choice forces a call)."""
    fmt = request.response_format
    if fmt is not None and fmt.type in ("json_object", "json_schema"):
        return "response_format"
    for field in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"):
        if getattr(request, field) is not None:
            return field
    return "tools"


def logit_bias_of(request: SamplingRequest, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} as {int: float}; 400 for an id outside the vocabulary."""
    if not request.logit_bias:
        return None
    bias = {int(k): float(v) for k, v in request.logit_bias.items()}
    bad = [t for t in bias if t >= vocab_size]
    if bad:
        raise _bad(f"logit_bias token id {bad[0]} is out of range [0, {vocab_size})", "logit_bias")
    return bias


def best_of_choices(choices: list, n: int) -> list:
    """The n choices with the highest cumulative logprob (OpenAI's best_of), renumbered 0..n-1."""
    from dataclasses import replace

    ranked = sorted(choices, key=lambda c: c.cumulative_logprob if c.cumulative_logprob is not None else 0.0,
                    reverse=True)[:n]
    return [replace(c, index=i) for i, c in enumerate(ranked)]


def prompt_logprobs_json(prompt_logprobs) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's JSON shape: None for the first token, then {"token_id": {"logprob", "rank", "decoded_token"}}."""
    if prompt_logprobs is None:
        return None
    return [None if step is None else {
        str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
        for t, lp in step.items()} for step in prompt_logprobs]
