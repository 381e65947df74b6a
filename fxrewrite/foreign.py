"""Refuse models whose modeling code was replaced (Liger-Kernel's ``apply_liger_kernel_to_*``, a user's patch).

Such patches swap names in a ``transformers.models.*.modeling_*`` module (``LlamaRMSNorm``,
``apply_rotary_pos_emb``, ``LlamaMLP``), class attributes (``LlamaForCausalLM.forward``) or an instance's
``forward``. The rewrite reads transformers' source and proves its patterns on it, and drops the modules it
fuses, so code that is no longer what runs would make the proof wrong or be silently lost. Detection:
- a function or class that the modeling file defines (by ``def`` / ``class`` at top level) must still be the one
  whose ``__module__`` is that file;
- that function, and the ``forward`` of every transformers or ``torch.nn`` class of the model's modules, must be
  code that lies in transformers' or torch's package folder, through every ``__wrapped__`` layer (judged by
  the code's file, since ``functools.wraps`` copies the wrapped function's ``__module__`` onto its wrapper;
  transformers' own decorators and ``torch.no_grad`` live there; Hugging Face ``kernels``' forward wrapper, which
  transformers >= 5.25 applies, is looked through, see `fxrewrite.hub_kernels`); a function that ``kernels``
  turned into a module instance must still call the file's own function, and no copy of it may be kernelized,
  replaced or hooked;
- no module of a transformers class may carry a ``forward`` of its own (a function, a ``types.MethodType``, a
  ``functools.partial``, e.g. accelerate's offloading hooks) other than its class's forward bound to it or the
  forward fxrewrite bound.
A module of another class (``nn.Linear``, a user's) with a forward of its own is no transformers code: the
compiler leaves it, and any module whose fusion would drop it, unfused, with the reason in the report.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys

from torch import nn

from fxrewrite import hub_kernels
from fxrewrite.origin import describe, outside_code
from fxrewrite.signature import BOUND_ATTR

__all__ = ["ForeignPatchError", "check_no_foreign_patches"]


class ForeignPatchError(RuntimeError):
    """Modeling code the model uses (transformers' or torch's) or a module's forward was replaced; the message
    names each replaced object."""


@functools.lru_cache(maxsize=None)
def _defined_names(filename: str) -> frozenset[str]:
    with open(filename, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return frozenset(n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)))


def _module_patches(modname: str) -> list[str]:
    mod = sys.modules.get(modname)
    filename = getattr(mod, "__file__", None)
    if not filename or not filename.endswith(".py"):
        return []
    found = []
    for name in sorted(_defined_names(filename)):
        obj = vars(mod).get(name)
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ != modname:
            found.append(f"{modname}.{name} is {describe(obj)}")
        elif isinstance(obj, nn.Module):  # transformers >= 5.25 with `kernels`: a function as a module instance
            func = hub_kernels.decorated_function(obj)
            if func is None or func.__module__ != modname or func.__name__ != name:
                found.append(f"{modname}.{name} calls {describe(func or type(obj).forward)}")
            elif (outside := outside_code(func)) is not None:
                found.append(f"{modname}.{name} is {outside}")
            found.extend(f"{modname}.{what}" for what in hub_kernels.replaced_functions(obj))
        elif inspect.isfunction(obj) and (outside := outside_code(obj)) is not None:
            found.append(f"{modname}.{name} is {outside}")
    return found


def _instance_forward(module: nn.Module, name: str) -> str | None:
    """What replaced the forward of `module` (of a transformers class) on the instance, or None: its class's
    forward bound to it (as accelerate's ``remove_hook_from_module`` leaves it) and fxrewrite's bound forward
    are no replacement."""
    own = module.__dict__.get("forward")
    if own is None or own is module.__dict__.get(BOUND_ATTR, (None, None))[1] or \
            not type(module).__module__.startswith("transformers."):
        return None
    if getattr(own, "__func__", None) is type(module).forward and getattr(own, "__self__", None) is module:
        return None
    return f"{type(module).__name__}.forward of this instance ({name or 'the model'}) is {describe(own)}"


def foreign_patches(model: nn.Module) -> list[str]:
    """Descriptions of every replaced piece of modeling code the model uses, or forward ([] when none)."""
    found: list[str | None] = []
    modules, classes = set(), set()
    for name, module in model.named_modules():
        found.append(_instance_forward(module, name))
        found.extend(f"{what} (the copy of {name or 'the model'})" for what in hub_kernels.replaced_functions(module))
        for copy in (module.__dict__.get("_kernel_funcs") or {}).values():
            if (func := hub_kernels.decorated_function(copy)) is not None and (outside := outside_code(func)):
                found.append(f"{func.__name__} (the copy of {name or 'the model'}) calls {outside}")
        for cls in type(module).__mro__:
            if cls in classes or not cls.__module__.startswith(("transformers.", "torch.nn.")):
                continue
            classes.add(cls)
            if cls.__module__.startswith("transformers.models."):
                modules.add(cls.__module__)
            fwd = cls.__dict__.get("forward")
            if fwd is not None and (outside := outside_code(fwd)) is not None:
                found.append(f"{cls.__module__}.{cls.__name__}.forward is {outside}")
    for modname in sorted(modules):
        found.extend(_module_patches(modname))
    return sorted({f for f in found if f is not None})


def check_no_foreign_patches(model: nn.Module) -> None:
    """ForeignPatchError naming each replaced function/class/forward (e.g. by Liger-Kernel), else nothing."""
    hooked = [name or "the model" for name, module in model.named_modules() if hasattr(module, "_hf_hook")]
    if hooked:
        raise ForeignPatchError(
            f"fxrewrite.optimize refuses a model dispatched by accelerate ({len(hooked)} modules run through its "
            f"hooks, e.g. {hooked[0]}): a device_map that offloads to the CPU or disk, or splits the model over "
            "devices, moves weights at call time, which the rewrite's fused layers would bypass. Load the model "
            "onto one device (device_map=None, or a single device: from_pretrained(..., device_map='cuda')) and "
            "optimize that.")
    found = foreign_patches(model)
    if found:
        raise ForeignPatchError(
            "fxrewrite.optimize refuses a model whose modeling code was replaced (by another library or by hand): "
            + "; ".join(found[:6]) + (f" (and {len(found) - 6} more)" if len(found) > 6 else "")
            + ". The rewrite proves its fusions on transformers' own code and would drop the replacement; load the "
            "model without the patch (e.g. do not call apply_liger_kernel_to_* or kernels.kernelize, in a fresh "
            "process) or restore the original forward.")
