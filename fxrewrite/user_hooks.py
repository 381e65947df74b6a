"""Keep users' module hooks out of the runs `optimize` makes for itself (meta tensors, probes).

`optimize` calls modules outside the user's forward: the meta run that records every module's inputs and the
traces (`fxrewrite.tracer`, meta tensors), and the patterns' probes (an activation on a ramp, a rotary module
at a few positions, MoE experts and a logits transform on random inputs). A hook registered on a module
(``register_forward_hook``, ``register_forward_pre_hook``, backward hooks) or on every module
(``torch.nn.modules.module.register_module_forward_hook`` and the like) would receive those tensors: ``.item()``
on a meta tensor raises, and logged activations would be garbage. Within `suspended(module)` none of them runs.
On exit every hook is back in the very dict it was in (so its handle still removes it), in its order, also
when the block raised; hooks registered inside and not removed (the tracer removes its own) come after them.

Hooks decide what `optimize` may fuse only outside these blocks: a hooked module that a fusion would delete
(``q_proj`` fused into ``qkv_proj``) or replace stays unfused, with the reason in the report
(`fxrewrite.compiler`), so the user's hooks run on the real forward after `optimize` as before.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn
from torch.nn.modules import module as torch_module

__all__ = ["drop_output_recorders", "global_hooks", "suspended"]

_MODULE_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")
_GLOBAL_DICTS = (*_GLOBAL_HOOKS, "_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called")
_RECORDERS_MODULE = "transformers.utils.output_capturing"
_RECORDERS_MARK = "_output_capturing_hooks_installed"


def global_hooks() -> int:
    """How many forward / backward hooks torch runs for every module (``register_module_*_hook``)."""
    return sum(len(getattr(torch_module, name, ())) for name in _GLOBAL_HOOKS)


@contextlib.contextmanager
def suspended(module: nn.Module) -> Iterator[None]:
    """Within: no hook of `module` or of a module below it, and no global module hook, runs (module doc)."""
    dicts = [d for m in module.modules() for name in _MODULE_DICTS if (d := m.__dict__.get(name))]
    dicts += [d for name in _GLOBAL_DICTS if (d := getattr(torch_module, name, None))]
    saved = [(d, dict(d)) for d in dicts]
    for d, _ in saved:
        d.clear()  # in place: torch reads these dicts at each call, the handles point at them
    try:
        yield
    finally:
        for d, hooks in saved:
            added = dict(d)
            d.clear()
            d.update(hooks)
            d.update(added)


def drop_output_recorders(model: nn.Module) -> int:
    """Remove transformers' output recorders from `model`'s modules; returns how many were removed.

    transformers installs them (read-only forward hooks, `transformers.utils.output_capturing`, on the router, the
    attention and the decoder layers) on the first call that asks for router logits, attentions or hidden states (a
    config with ``output_router_logits=True`` makes `optimize`'s own meta run that call), marks the model, and never
    removes them. Left in place they read as the user's hooks, so a fused MoE block, say, was refused ("hooks on
    child 'gate'") for a model loaded with ``output_router_logits=True``. Without them and the mark, transformers
    installs them again, on the rewritten modules, at the next such call: the path of a model that asks for those
    outputs only after `optimize`."""
    removed = 0
    for module in model.modules():
        hooks = module.__dict__.get("_forward_hooks") or {}
        for key in [k for k, h in hooks.items() if getattr(h, "__module__", None) == _RECORDERS_MODULE]:
            del hooks[key]
            for extra in ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
                (module.__dict__.get(extra) or {}).pop(key, None)
            removed += 1
        module.__dict__.pop(_RECORDERS_MARK, None)
    return removed
