"""Run each distinct (module structure, input metadata) on meta tensors once; reuse its output shapes.

`optimize` runs modules on meta tensors several times: the whole model once to record every module's inputs
(`fxrewrite.tracer.record_calls`), and again inside each trace, where a parent calls its children to learn
their output shapes (Qwen3-4B: 36 identical decoder layers, each run per trace of the model and of the causal
LM). A meta run computes nothing but shapes, dtypes and strides, and those follow from the module's structure
and its inputs' metadata alone. So, within `memoized`, a module whose `fxrewrite.signature.structure_key` and
`fxrewrite.signature.input_key` equal those of an earlier run returns fresh meta tensors shaped like that
run's output, without running. Only runs whose inputs and outputs are all meta tensors and plain values are
stored (never real data); a module with hooks or a forward replaced on the instance has a key of its own.
``MetaMemo.aliases`` says which earlier module each skipped one stood in for, so the inputs its children
would have received can be found (`fxrewrite.tracer.record_calls`).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Hashable, Iterator

import torch
from torch import nn

from fxrewrite.signature import MEMO_ATTR, input_key, structure_key

__all__ = ["MetaMemo", "memoized", "with_parameters"]


class MetaMemo:
    """Outputs of meta runs by (structure key, input key), and which module stood in for which."""

    def __init__(self) -> None:
        self.outputs: dict[Hashable, tuple[weakref.ref, object]] = {}
        self.aliases: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        """id(skipped module) -> weak references (skipped module, the module whose run it reused), in call
        order (weak: the memo must not keep modules that a rewrite deletes, and their weights, alive)."""
        self.hits = 0


def with_parameters(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` holding a parameter themselves or below (those `memoized` is worth wrapping)."""
    found: set[int] = set()
    for module in reversed(list(model.modules())):  # children first
        if any(p is not None for p in module._parameters.values()) or any(
                id(c) in found for c in module._modules.values() if c is not None):
            found.add(id(module))
    return [m for m in model.modules() if id(m) in found]


def _all_meta(value) -> bool:
    """True for meta tensors, plain values and tuples / lists / dicts of them; False for anything else."""
    if isinstance(value, torch.Tensor):
        return value.is_meta and type(value) in (torch.Tensor, nn.Parameter)
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return all(_all_meta(v) for v in value)
    if type(value) is dict:
        return all(_all_meta(v) for v in value.values())
    return isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size))


def _fresh(value):
    """A new meta tensor for every tensor of `value` (same shape, strides, dtype); the rest as it is."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_fresh(v) for v in value)
    if type(value) is dict:
        return {k: _fresh(v) for k, v in value.items()}
    return value


def _wrapper(module: nn.Module, memo: MetaMemo, key_of: Callable[[nn.Module], Hashable]):
    previous = module.__dict__.get("forward")
    call = previous if previous is not None else type(module).forward.__get__(module)

    def forward(*args, **kwargs):
        if not _all_meta((args, kwargs)):
            return call(*args, **kwargs)
        key = (key_of(module), input_key(args, kwargs))
        hit = memo.outputs.get(key)
        if hit is not None:
            memo.hits += 1
            memo.aliases.setdefault(id(module), (weakref.ref(module), hit[0]))
            return _fresh(hit[1])
        out = call(*args, **kwargs)
        if _all_meta(out):
            memo.outputs[key] = (weakref.ref(module), _fresh(out))
        return out

    setattr(forward, MEMO_ATTR, previous)
    return forward


@contextlib.contextmanager
def memoized(modules, memo: MetaMemo, key_of: Callable[[nn.Module], Hashable] | None = None) -> Iterator[MetaMemo]:
    """Within: calls of `modules` on meta tensors go through `memo` (see the module doc). `key_of` gives a
    module's structure key (default: computed at each call; a caller whose modules carry hooks of its own
    passes keys computed before it added them). On exit each module's ``forward`` is what it was, unless
    something else replaced the wrapper meanwhile (then that stays)."""
    wrapped, key_of = [], key_of or (lambda m: structure_key(m))
    for module in modules:
        forward = _wrapper(module, memo, key_of)
        module.__dict__["forward"] = forward
        wrapped.append((module, forward))
    try:
        yield memo
    finally:
        for module, forward in wrapped:
            if module.__dict__.get("forward") is forward:
                previous = getattr(forward, MEMO_ATTR)
                if previous is None:
                    del module.__dict__["forward"]
                else:
                    module.__dict__["forward"] = previous
