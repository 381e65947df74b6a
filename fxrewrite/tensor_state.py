"""Keep a module tree's tensors exactly as they were while foreign code runs on it.

The tracer runs transformers' modeling code on meta tensors, and the rotary pattern probes a
transformers rotary module for real: both execute Python that assigns attributes and copies into
buffers. `preserved_state` undoes every such change on exit.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn


def _tensor_state(module: nn.Module) -> dict[str, dict[str, Any]]:
    """A module's own tensors by kind: parameters, buffers, plain tensor attributes (in __dict__)."""
    plain = {k: v for k, v in module.__dict__.items() if isinstance(v, torch.Tensor)}
    return {"_parameters": dict(module._parameters), "_buffers": dict(module._buffers), "plain": plain}


@contextlib.contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Leave every tensor that a module of `model` holds exactly as it was, whatever runs inside.

    Running a model on meta executes its Python: transformers' dynamic / longrope rotary update
    assigns `long_inv_freq` / `inv_freq` (meta tensors here) and copies into buffers in place, and
    fx stores `_tensor_constantN` attributes on the traced root. On exit each module's parameters,
    buffers and plain tensor attributes are the same objects as before (new ones removed), and
    buffers and plain attributes hold their old values (restored in place where they changed).
    """
    modules = list(model.modules())
    saved = [_tensor_state(m) for m in modules]
    values = [{k: v.detach().clone() for kind in ("_buffers", "plain") for k, v in s[kind].items()
               if v is not None and not v.is_meta} for s in saved]
    try:
        yield
    finally:
        for module, state, value in zip(modules, saved, values):
            _restore(module, state, value)


def _restore(module: nn.Module, state: dict[str, dict[str, Any]], values: dict[str, torch.Tensor]) -> None:
    for kind in ("_parameters", "_buffers"):
        getattr(module, kind).clear()
        getattr(module, kind).update(state[kind])
    for key in [k for k, v in module.__dict__.items() if isinstance(v, torch.Tensor) and k not in state["plain"]]:
        del module.__dict__[key]
    module.__dict__.update(state["plain"])
    with torch.no_grad():
        for key, old in values.items():
            now = state["_buffers"].get(key, state["plain"].get(key))
            if not torch.equal(now, old):
                now.copy_(old)
