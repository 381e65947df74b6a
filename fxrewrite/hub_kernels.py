"""Seeing through Hugging Face ``kernels``' decorators, which transformers >= 5.25 applies to its modeling code.

With the ``kernels`` package installed (a dependency of transformers 5.25), ``@use_kernel_forward_from_hub`` turns
a modeling file's function (``apply_rotary_pos_emb``) into an instance of a parameterless ``nn.Module`` class
whose forward calls the function, and ``@use_kernelized_func`` wraps an attention class's ``forward`` (a
``functools.wraps`` wrapper) so that calls of that instance reach the module's private copy of it
(``module._kernel_funcs``). Until ``kernels.kernelize`` swaps a hub kernel into one of those copies (it sets an
instance ``forward``), every call runs transformers' own function: the tracer and the foreign-patch check look
through them; a kernelized, replaced or hooked copy is a replacement like any other (`replaced_functions`).
"""

from __future__ import annotations

import inspect
import os
import sys
import types

from torch import nn

__all__ = ["decorated_function", "is_wrapper_code", "pristine", "replaced_functions"]


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


def replaced_functions(module: nn.Module) -> list[str]:
    """What is no longer transformers' function among `module`'s private copies (``module._kernel_funcs``) and, when
    `module` is a module-level decorated instance, in it: "<name> is <what>" for a copy of another class (or
    a class whose forward calls no function), one with an instance forward (``kernels.kernelize`` sets one) or one
    with forward hooks (the tracer calls the function itself, so they would be lost)."""
    copies = [(name, fn) for name, fn in (module.__dict__.get("_kernel_funcs") or {}).items()]
    if decorated_function(module) is not None:
        copies.append((decorated_function(module).__name__, module))
    found = []
    for name, fn in copies:
        name = getattr(decorated_function(fn), "__name__", name)
        if decorated_function(fn) is None:
            found.append(f"{name} is a {type(fn).__module__}.{type(fn).__qualname__}")
        elif "forward" in fn.__dict__:
            found.append(f"{name} is a hub kernel (kernels.kernelize)")
        elif any(getattr(fn, h, None) for h in _HOOKS):
            found.append(f"{name} has hooks")
    return found


def pristine(obj) -> bool:
    """Whether `obj` is a decorated-function instance that still just calls its function (see `replaced_functions`)."""
    return decorated_function(obj) is not None and not replaced_functions(obj)


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
