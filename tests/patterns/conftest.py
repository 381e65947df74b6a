"""Shared helpers of the pattern tests."""

from __future__ import annotations

import torch


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


def assert_same_gradients(ref, model, x, fused: str, parts: tuple[str, ...]) -> None:
    """Backward of a squared-mean loss through `ref` (stock) and `model` (optimized) on x: every parameter's gradient
    equal (float32 tolerance), a fused child's (``<parent>.<fused>.<kind>``) to its parts' gradients concatenated."""
    ref(x).square().mean().backward()
    model(x).square().mean().backward()
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        parent, child, kind = name.rsplit(".", 2) if name.count(".") >= 2 else ("", "", name)
        if child == fused:
            want = torch.cat([grads[f"{parent}.{part}.{kind}"].grad for part in parts])
        else:
            want = grads[name].grad
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-6)
