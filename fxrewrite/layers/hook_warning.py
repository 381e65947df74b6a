"""Modules whose hooks would not see what a user expects after `fxrewrite.optimize`: registering one warns.

A fused-away projection (`fxrewrite.weights.FusedAway`) is never called; a norm whose calls the rewrite changed
(`fxrewrite.layers.layernorm.RMSNorm`) sees other inputs and outputs than transformers' code gave it. A warning, not an
error: tools that hook every module (DeepSpeed ZeRO-3, model summaries) must keep working.
"""

from __future__ import annotations

import warnings

__all__ = ["WarnsOnHooks"]


class WarnsOnHooks:
    """`nn.Module` mixin (before the module class): each ``register_*hook`` method warns (UserWarning, at the caller's
    line) with `_hook_warning_text` when it returns text, then registers the hook as usual."""

    def _hook_warning_text(self) -> str | None:
        return None

    def _registered(self, register, hook, *args, adapted: bool = False, **kwargs):
        text = self._hook_warning_text(adapted) if adapted else self._hook_warning_text()
        if text:
            warnings.warn(text, UserWarning, stacklevel=3)
        return register(hook, *args, **kwargs)

    def register_forward_hook(self, hook, *args, **kwargs):
        """`nn.Module.register_forward_hook`, with the warning."""
        return self._registered(super().register_forward_hook, hook, *args, **kwargs)

    def register_forward_pre_hook(self, hook, *args, **kwargs):
        """`nn.Module.register_forward_pre_hook`, with the warning."""
        return self._registered(super().register_forward_pre_hook, hook, *args, **kwargs)

    def register_full_backward_hook(self, hook, *args, **kwargs):
        """`nn.Module.register_full_backward_hook`, with the warning."""
        return self._registered(super().register_full_backward_hook, hook, *args, **kwargs)

    def register_full_backward_pre_hook(self, hook, *args, **kwargs):
        """`nn.Module.register_full_backward_pre_hook`, with the warning."""
        return self._registered(super().register_full_backward_pre_hook, hook, *args, **kwargs)
