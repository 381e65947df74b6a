"""When a decoder-layer fold of the rewrite may take its fused path (`fxrewrite.layers.gated_mlp`,
`fxrewrite.layers.input_norm`): those paths call a module's children, or hand a module an input its forward does not
expect on its own, so they run only where nothing else could observe the difference."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _module
from transformers.utils import output_capturing

from fxrewrite.signature import BOUND_ATTR, instance_forward

__all__ = ["foreign_forward", "fused_call_allowed", "global_module_hooks", "runs_bound_forward", "unhooked"]

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


def foreign_forward(module: nn.Module) -> bool:
    """A ``forward`` was put on `module`'s instance by someone other than fxrewrite (``module.forward = ...``, a
    `functools.partial`, accelerate's ``add_hook_to_module``): calling the module runs it, so it is a hook too."""
    own, bound = instance_forward(module), module.__dict__.get(BOUND_ATTR)
    return own is not None and (bound is None or own is not bound[1])


def _idle_recorder(hook) -> bool:
    """`hook` is one of transformers' output recorders (`transformers.utils.output_capturing`: forward hooks, put on the
    attention, decoder layer and router modules by the first call asking for attentions, hidden states or router
    logits, that append the module's output to the active collector) and no call is recording: it does nothing then.
    Under torch.compile's tracing it counts as a hook (the collector's ContextVar is not read there)."""
    collector = getattr(output_capturing, "_active_collector", None)  # transformers 5.x's, checked 5.17 to 5.25
    return (getattr(hook, "__module__", None) == output_capturing.__name__ and collector is not None
            and not torch.compiler.is_compiling() and collector.get() is None)


def unhooked(*modules: nn.Module) -> bool:
    """No forward / backward hook on any of `modules` but an idle output recorder of transformers' (`_idle_recorder`: a
    fresh user's find: one call with ``output_hidden_states=True`` after optimize left the folds off for every later
    call), no forward put on one's instance since (`foreign_forward`; a fresh user's find: one on ``lm_head``,
    ``act_fn`` or ``down_proj`` set after optimize was silently skipped by the fused loss / activation), and no
    global module hook."""
    if global_module_hooks():
        return False
    hooks = (hook for m in modules for name in _HOOKS for hook in (m.__dict__.get(name) or {}).values())
    return all(map(_idle_recorder, hooks)) and not any(map(foreign_forward, modules))
