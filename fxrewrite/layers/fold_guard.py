"""When a decoder-layer fold of the rewrite may take its fused path (`fxrewrite.layers.gated_mlp`,
`fxrewrite.layers.input_norm`): those paths call a module's children, or hand a module an input its forward does not
expect on its own, so they run only where nothing else could observe the difference."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _module

from fxrewrite.signature import BOUND_ATTR

__all__ = ["fused_call_allowed", "global_module_hooks", "runs_bound_forward", "unhooked"]

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def fused_call_allowed(x: torch.Tensor) -> bool:
    """No torch.compile tracing (Inductor gets the plain ops; the skinny GEMV does not run there), no autograd (training
    keeps the modules' own forwards and backwards) and no autocast on x's device."""
    return not (torch.compiler.is_compiling() or torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type))


def runs_bound_forward(module: nn.Module) -> bool:
    """`module` still runs the forward fxrewrite bound to it (none was put on the instance since)."""
    bound = module.__dict__.get(BOUND_ATTR)
    return bound is not None and module.__dict__.get("forward") is bound[1]


def global_module_hooks() -> bool:
    """A global forward (pre-)hook is set (`torch.nn.modules.module.register_module_forward_hook`)."""
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks)


def unhooked(*modules: nn.Module) -> bool:
    """No forward / backward hook on any of `modules`, and no global module hook."""
    if global_module_hooks():
        return False
    return not any(m.__dict__.get(h) for m in modules for h in _HOOKS)
