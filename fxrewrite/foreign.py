"""Refuse models whose transformers modeling code another library replaced (Liger-Kernel's ``apply_liger_kernel_to_*``).

Such patches swap names in a ``transformers.models.*.modeling_*`` module (``LlamaRMSNorm``,
``apply_rotary_pos_emb``, ``LlamaMLP``), class attributes (``LlamaForCausalLM.forward``) or an instance's
``forward``. The rewrite reads transformers' source and proves its patterns on it, so code that is no
longer what runs would make the proof wrong. Detection: a function or class that the modeling file
defines (by ``def`` / ``class`` at top level) must still be the one whose ``__module__`` is that file;
every ``forward`` of the model's transformers classes, and every instance-level ``forward``, must come
from a transformers module (fxrewrite's own rewritten forwards are compiled in those modules too).
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys

from torch import nn

__all__ = ["ForeignPatchError", "check_no_foreign_patches"]


class ForeignPatchError(RuntimeError):
    """transformers code used by the model was replaced by another library; the message names it."""


@functools.lru_cache(maxsize=None)
def _defined_names(filename: str) -> frozenset[str]:
    with open(filename, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return frozenset(n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)))


def _origin(obj) -> str:
    obj = getattr(obj, "__func__", obj)
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"


def _is_transformers(obj) -> bool:
    obj = getattr(obj, "__func__", obj)
    return str(getattr(obj, "__module__", "")).startswith("transformers.")


def _module_patches(modname: str) -> list[str]:
    mod = sys.modules.get(modname)
    filename = getattr(mod, "__file__", None)
    if not filename or not filename.endswith(".py"):
        return []
    found = []
    for name in sorted(_defined_names(filename)):
        obj = vars(mod).get(name)
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ != modname:
            found.append(f"{modname}.{name} is {_origin(obj)}")
    return found


def foreign_patches(model: nn.Module) -> list[str]:
    """Descriptions of every replaced piece of transformers code the model uses ([] when none)."""
    found: list[str] = []
    modules = set()
    for module in model.modules():
        own = module.__dict__.get("forward")
        if own is not None and not _is_transformers(own) and type(module).__module__.startswith("transformers."):
            found.append(f"{type(module).__name__}.forward of this instance is {_origin(own)}")
        for cls in type(module).__mro__:
            if not cls.__module__.startswith("transformers.models."):
                continue
            modules.add(cls.__module__)
            fwd = cls.__dict__.get("forward")
            if fwd is not None and not _is_transformers(fwd):
                found.append(f"{cls.__module__}.{cls.__name__}.forward is {_origin(fwd)}")
    for modname in sorted(modules):
        found.extend(_module_patches(modname))
    return sorted(set(found))


def check_no_foreign_patches(model: nn.Module) -> None:
    """ForeignPatchError naming each replaced function/class/forward (e.g. by Liger-Kernel), else nothing."""
    found = foreign_patches(model)
    if found:
        raise ForeignPatchError(
            "fxrewrite.optimize refuses a model whose transformers code another library replaced: "
            + "; ".join(found[:6]) + (f" (and {len(found) - 6} more)" if len(found) > 6 else "")
            + ". fxrewrite already fuses these ops; load the model without the other library's patch "
            "(e.g. do not call apply_liger_kernel_to_*), in a fresh process.")
