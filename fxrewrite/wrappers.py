"""Refuse a model that torch.compile, DDP, DataParallel, FSDP or accelerate took over before `optimize`.

Each keeps its own view of the model that a rewrite in place would leave stale: torch.compile's
``OptimizedModule`` and ``nn.Module.compile()`` compile the forward as it was (and would push optimize's meta
runs through dynamo: the run fails, part of the model is rewritten, part not); ``DistributedDataParallel``
registered the parameters that fusion replaces (the fused ones would get no gradient all-reduce);
``DataParallel`` and FSDP hide the model's config or shard its parameters; accelerate's ``Accelerator.prepare``
under mixed precision replaces the model's forward with its autocast wrapper. Each composes when applied to the
optimized model, which is what the error says. PEFT's ``PeftModel`` is no such wrapper: it is optimized
through (the LoRA-wrapped projections stay unfused; see ``fxrewrite.nodes``).
"""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["check_not_wrapped"]


def _wrapper(module: nn.Module) -> tuple[str, str] | None:
    """(what `module` is, how to apply it after optimize) when it is a wrapper of the module doc, else None."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # never imported: nothing can be compiled
    if dynamo is not None and isinstance(module, dynamo.OptimizedModule):
        inner = type(getattr(module, "_orig_mod", None)).__name__
        return (f"a torch.compile'd module (OptimizedModule around {inner})",
                "torch.compile the result: torch.compile(fxrewrite.optimize(model), ...)")
    if "_original_forward" in module.__dict__:  # what Accelerator.prepare keeps when it wraps forward in autocast
        return ("prepared by accelerate's Accelerator.prepare (its mixed-precision wrapper replaced the forward)",
                "accelerator.prepare the optimized model")
    if getattr(module, "_compiled_call_impl", None) is not None:
        return "compiled in place with nn.Module.compile()", "call .compile() on the optimized model"
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kinds = [(nn.parallel.DistributedDataParallel, "DistributedDataParallel"), (nn.DataParallel, "DataParallel")]
    if fsdp is not None:
        kinds += [(getattr(fsdp, "FullyShardedDataParallel", ()), "FullyShardedDataParallel"),
                  (getattr(fsdp, "FSDPModule", ()), "fully_shard (FSDP2)")]
    for cls, name in kinds:
        if isinstance(module, cls):
            return f"wrapped by {name}", f"apply {name} to the optimized model"
    return None


def check_not_wrapped(model: nn.Module) -> None:
    """TypeError naming the first module of `model` (itself included) that a wrapper of the module doc took
    over, and the fix (optimize the plain model first, then apply the wrapper); else nothing."""
    for name, module in model.named_modules():
        found = _wrapper(module)
        if found is not None:
            where = "the model" if not name else f"submodule {name!r} ({type(module).__name__})"
            raise TypeError(f"fxrewrite.optimize needs the plain model, but {where} is {found[0]}: call "
                            f"fxrewrite.optimize(model) on the plain model first, then {found[1]}")
