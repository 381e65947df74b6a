"""Where a function's code comes from: transformers' or torch's package folder, or somewhere else.

`fxrewrite.foreign` refuses a model whose modeling code was replaced, and a pattern refuses a registered
implementation (transformers' experts or attention registries) that is not transformers' own code; both judge by the
code's file, since ``functools.wraps`` copies the wrapped function's ``__module__`` onto its wrapper.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from fxrewrite import hub_kernels

__all__ = ["describe", "outside_code"]


def describe(obj) -> str:
    """``module.qualname`` of `obj`; for a wrapper, where its code is; for code outside transformers' and torch's
    folders whose names claim otherwise, also where that code is."""
    obj = getattr(obj, "__func__", obj)
    if isinstance(obj, functools.partial):
        return f"functools.partial of {describe(obj.func)}"
    name = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"
    code = getattr(obj, "__code__", None)
    if code is not None and hasattr(obj, "__wrapped__"):  # its names were copied from the function it wraps
        return f"a wrapper defined at {code.co_filename}:{code.co_firstlineno} (named {name})"
    if code is not None and name.startswith(("transformers.", "torch.")) and not code.co_filename.startswith(_homes()):
        return f"{name} with code from {code.co_filename}:{code.co_firstlineno}"  # e.g. its __code__ swapped
    return name


def _homes() -> tuple[str, ...]:
    return tuple(os.path.dirname(p.__file__) + os.sep for p in (sys.modules.get("transformers"), torch)
                 if getattr(p, "__file__", None))


def outside_code(fn) -> str | None:
    """`describe` of the first layer of `fn` (through ``__wrapped__``) whose code is not in transformers' or
    torch's package folder, or that has no code of its own (a partial); None when every layer's is."""
    homes = _homes()
    for _ in range(64):  # a __wrapped__ cycle must not hang
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        transparent = code is not None and hasattr(fn, "__wrapped__") and hub_kernels.is_wrapper_code(code)
        if code is None or not (transparent or code.co_filename.startswith(homes)):
            return describe(fn)
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return None
    return describe(fn)
