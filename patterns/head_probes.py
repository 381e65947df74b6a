"""Probes for `feature_path`: whether a module or a function call acts on each attention head alone, tried on
seeded random float32 inputs of the traced shapes and split by heads as tensor-parallel ranks hold them (a check on
values, as `rotary_calls.same_outputs` checks a rotary apply, for code whose source cannot be read as a formula)."""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch import nn

from fxrewrite import nodes

__all__ = ["stateless", "module_splits_by_heads", "call_splits_by_heads"]


def stateless(module: nn.Module) -> bool:
    """Whether `module` holds no parameters or buffers (so it can run on CPU inputs, whatever device the model is on,
    meta included)."""
    return next(module.parameters(), None) is None and next(module.buffers(), None) is None


def module_splits_by_heads(module: nn.Module, meta, axis: int) -> bool:
    """Whether `module` (no parameters or buffers) gives, for seeded random float32 input of the traced shape,
    each head's output from that head's input alone."""
    x = torch.randn(meta.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    try:
        with torch.no_grad():
            full = module(x)
            return isinstance(full, torch.Tensor) and full.shape == x.shape and all(
                torch.allclose(module(x.narrow(axis, h, 1)), full.narrow(axis, h, 1), rtol=1e-5, atol=1e-6)
                for h in range(x.shape[axis]))
    except Exception:  # noqa: BLE001 - a module that fails on these inputs is not proven
        return False


def call_splits_by_heads(n: fx.Node, ins: list, axis: int) -> type | None:
    """Whether the call, on seeded random float32 tensors of the traced shapes, gives for each group of heads of
    its inputs `ins` (gcd of their head counts: as tensor-parallel ranks hold them) the outputs it gives there for
    all heads at once: the type it returns (a tensor, or a tuple / list of them), or None when it does not."""
    gen = torch.Generator().manual_seed(0)

    def sample(a):
        meta = nodes.meta(a) if isinstance(a, fx.Node) else None
        return torch.randn(meta.shape, generator=gen, dtype=torch.float32) if meta is not None else a

    args, kwargs = [sample(a) for a in n.args], {k: sample(v) for k, v in n.kwargs.items()}
    at = [i for i, a in enumerate(n.args) if a in ins]
    groups = math.gcd(*(args[i].shape[axis] for i in at))
    try:
        with torch.no_grad():
            whole = n.target(*args, **kwargs)
            full = _outputs(whole, [args[i] for i in at])
            for g in range(groups):
                part = list(args)
                for i in at:
                    part[i] = args[i].narrow(axis, g * (args[i].shape[axis] // groups), args[i].shape[axis] // groups)
                got = _outputs(n.target(*part, **kwargs), [part[i] for i in at])
                want = [f.narrow(axis, g * (f.shape[axis] // groups), f.shape[axis] // groups) for f in full]
                if not all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want)):
                    return None
    except Exception:  # noqa: BLE001 - a function that fails on these inputs (or `_outputs`) is not proven
        return None
    return torch.Tensor if isinstance(whole, torch.Tensor) else tuple


def _outputs(out, inputs: list) -> list:
    """The call's outputs as a list, each shaped as the input in its place (ValueError otherwise)."""
    outs = [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, (tuple, list)) else []
    if len(outs) != len(inputs) or any(not isinstance(o, torch.Tensor) or o.shape != i.shape
                                       for o, i in zip(outs, inputs)):
        raise ValueError("outputs are not shaped as the inputs on the paths")
    return outs
