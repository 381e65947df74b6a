"""Shared helpers of the pattern tests."""

from __future__ import annotations


def count_calls(monkeypatch, cls: type, method: str) -> list:
    """A list that grows by one each time ``cls.<method>`` runs (the method still runs): how often a fused path was
    taken."""
    calls = []
    original = getattr(cls, method)

    def spy(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, spy)
    return calls
