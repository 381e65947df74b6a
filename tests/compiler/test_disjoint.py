"""No fx node is claimed by two pattern matches (patterns are disjoint by construction)."""

import sys
from pathlib import Path

import pytest

from fxrewrite import tracer
from fxrewrite.patterns import PATTERNS, Context, Refusal

from tests.e2e.tiny_models import ARCHS, tiny_model  # noqa: E402


@pytest.mark.parametrize("arch", list(ARCHS))
def test_no_node_claimed_twice(arch):
    model = tiny_model(arch)
    records, error = tracer.record_inputs(model)
    assert error is None
    ctx = Context(model, model.config)
    total = 0
    for cls, (module, args, kwargs) in records.items():
        traced = tracer.trace(module, args, kwargs)
        owner: dict[str, str] = {}
        for pattern in PATTERNS:
            try:
                matches = pattern.match(traced, ctx)
            except Refusal:
                continue
            for m in matches:
                for node in m.claimed:
                    assert node not in owner, f"{cls.__name__}: {node} claimed by {owner[node]} and {pattern.name}"
                    owner[node] = pattern.name
        total += len(owner)
    assert total > 0
