"""Seeing through Hugging Face ``kernels``' decorators, which transformers >= 5.25 applies to its modeling code.

With the ``kernels`` package installed (a dependency of transformers 5.25), ``@use_kernel_forward_from_hub`` turns
a modeling file's function (``apply_rotary_pos_emb``) into an instance of a parameterless ``nn.Module`` class
whose forward calls the function, and ``@use_kernelized_func`` wraps an attention class's ``forward`` (a
``functools.wraps`` wrapper) so that calls of that instance reach the module's private copy of it
(``module._kernel_funcs``). Until ``kernels.kernelize`` swaps a hub kernel into one of those copies (it sets an
instance ``forward``), every call runs transformers' own function: the tracer and the foreign-patch check look
through them; a kernelized copy is a replacement like any other.
"""

from __future__ import annotations

import inspect
import os
import sys
import types

from torch import nn

__all__ = ["decorated_function", "is_wrapper_code", "kernelized_functions"]


def decorated_function(obj) -> types.FunctionType | None:
    """The function that ``@use_kernel_forward_from_hub`` turned into the module instance `obj`, or None when
    `obj` is no such instance (its class has a ``kernel_layer_name`` and a forward closing over ``func``)."""
    if not isinstance(obj, nn.Module) or not hasattr(type(obj), "kernel_layer_name"):
        return None
    try:
        func = inspect.getclosurevars(type(obj).forward).nonlocals.get("func")
    except (TypeError, ValueError):
        return None
    return func if isinstance(func, types.FunctionType) else None


def is_wrapper_code(code: types.CodeType) -> bool:
    """Whether `code` is the installed ``kernels`` package's (``use_kernelized_func``'s forward wrapper)."""
    pkg = sys.modules.get("kernels")
    home = getattr(pkg, "__file__", None)
    return home is not None and hasattr(pkg, "use_kernelized_func") and \
        code.co_filename.startswith(os.path.dirname(home) + os.sep)


def kernelized_functions(module: nn.Module) -> list[str]:
    """Names of `module`'s private function copies (``module._kernel_funcs``) whose forward was replaced on the
    instance (by ``kernels.kernelize``), and of the module-level instance itself when `module` is one."""
    copies = list((module.__dict__.get("_kernel_funcs") or {}).values())
    if decorated_function(module) is not None:
        copies.append(module)
    return sorted(getattr(decorated_function(fn), "__name__", type(fn).__name__) for fn in copies
                  if isinstance(fn, nn.Module) and "forward" in fn.__dict__)
