"""JSON-schema keywords whose constraint xgrammar leaves out of the grammar it compiles: refused up front, rather
than met by chance in outputs that finish with "stop".

Found by compiling each keyword with xgrammar 0.2.9 (``Grammar.from_json_schema``) and asking whether it accepts a
string the keyword forbids (it did, for each below; it logs a warning for some, nothing for others): ``uniqueItems``,
``contains`` (and ``minContains`` / ``maxContains``), ``not``, ``if`` / ``then`` / ``else``, ``dependentRequired``,
``dependentSchemas``, an ``allOf`` of several schemas, ``multipleOf`` on a number that may be fractional or on an
integer bounded on one side only, and ``minLength`` / ``maxLength`` beside a ``pattern`` or a ``format``. vLLM's
xgrammar backend refuses schemas with keywords it cannot enforce too (its ``has_xgrammar_unsupported_json_features``).
Annotations (``contentEncoding``, ``title``, ``description``...) are not constraints and pass. Not refused:
``oneOf``, which xgrammar takes as ``anyOf`` (the same when the branches cannot both match, as a discriminated
union's; refusing it would refuse those too).
"""

from __future__ import annotations

from typing import Any

__all__ = ["unenforced_keyword"]

_DROPPED = {
    "uniqueItems": "the items may repeat",
    "contains": "no item need match it",
    "minContains": "no item need match 'contains'",
    "maxContains": "any number of items may match 'contains'",
    "not": "the excluded schema is not excluded",
    "if": "the conditional schema is not applied",
    "dependentRequired": "the dependent properties are not required",
    "dependentSchemas": "the dependent schemas are not applied",
}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "contains",
            "propertyNames", "not", "if", "then", "else", "additionalItems")


def unenforced_keyword(schema: Any) -> str | None:
    """A sentence naming the first keyword of `schema` (a parsed JSON schema) that xgrammar would not enforce and
    where it is (a JSON pointer), or None when every constraint is enforced. Walked with a stack, not recursion:
    any nesting depth xgrammar takes is checked."""
    stack = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        found = _dropped_here(node, path or "/")
        if found:
            return found
        subs = []
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                subs += [(sub, f"{path}/{key}/{name}") for name, sub in node[key].items()]
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                subs += [(sub, f"{path}/{key}/{i}") for i, sub in enumerate(node[key])]
        subs += [(node.get(key), f"{path}/{key}") for key in _SCHEMAS if key in node]
        stack += reversed(subs)  # the first subschema is checked first
    return None


def _dropped_here(schema: dict, where: str) -> str | None:
    for keyword, effect in _DROPPED.items():
        if keyword in schema and not (keyword == "uniqueItems" and schema[keyword] is False):
            return f"{keyword!r} at {where} is not enforced by xgrammar ({effect})"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"'allOf' of {len(schema['allOf'])} schemas at {where} is not enforced by xgrammar (merge them into one)"
    for shaped in ("pattern", "format"):
        if shaped in schema and {"minLength", "maxLength"} & schema.keys():
            return (f"'minLength' / 'maxLength' beside {shaped!r} at {where} are not enforced by xgrammar (put the "
                    "length in a pattern, e.g. {3,5})")
    step = schema.get("multipleOf")
    if isinstance(step, (int, float)) and (schema.get("type") != "integer" or step != int(step)):
        return f"'multipleOf' on a number at {where} is not enforced by xgrammar (only on integers)"
    low = {"minimum", "exclusiveMinimum"} & schema.keys()
    if step is not None and bool(low) != bool({"maximum", "exclusiveMaximum"} & schema.keys()):
        return (f"'multipleOf' with a bound on one side at {where} is not enforced by xgrammar (give both "
                "bounds, or none)")
    return None
