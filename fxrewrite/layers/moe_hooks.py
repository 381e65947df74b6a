"""Forward hooks on a `FusedMoE` block that see transformers' call, not the rewrite's.

The residual fold (`fxrewrite.patterns.rms_norm`, consumer "moe") calls a decoder layer's MoE block as
``mlp(e, norm=post_attention_layernorm, residual=r, add_residual=...)`` returning ``(r' + mlp(norm(r')), r')`` with
r' = e + r; transformers' layer calls ``mlp(norm(r'))`` and adds r' itself. A forward (pre-)hook registered on the
block after `optimize` (without kwargs) sees the latter: `Normalize` (a with_kwargs pre-hook, first) turns a folded
call into ``mlp(norm(r'), residual=ResidualTaken(r'), add_residual=...)``, which returns ``(out, r')``; the user's
hooks see ``(norm(r'),)`` and ``out`` and may replace either; `CloseResidual` (a with_kwargs forward hook, kept
last) then makes the folded call's own result. A final fresh user's find: a pre-hook scaling its input scaled the
attention output before the norm, silently; a forward hook got a tuple.
"""

from __future__ import annotations

from fxrewrite.layers.residual_hooks import ResidualTaken

__all__ = ["CloseResidual", "Normalize", "StockViewForwardHook", "StockViewPreHook"]


def _taken(kwargs: dict) -> bool:
    return isinstance(kwargs.get("residual"), ResidualTaken)


class Normalize:
    """With-kwargs pre-hook: a folded call becomes the block's call on the normed input, the sum kept aside."""

    def __call__(self, module, args, kwargs):
        norm = kwargs.get("norm")
        if norm is None or _taken(kwargs):
            return None
        x, r = norm(args[0], kwargs["residual"])
        return (x,), {"residual": ResidualTaken(r), "add_residual": kwargs.get("add_residual", False)}


class CloseResidual:
    """With-kwargs forward hook, run last: ``(out, r')`` -> the folded call's result."""

    def __call__(self, module, args, kwargs, output):
        if not _taken(kwargs):
            return None
        out, r = output
        return (r + out if kwargs.get("add_residual") else out), r


class StockViewPreHook:
    """A user's ``hook(module, args)``, given ``(norm(r'),)`` in a folded call (`Normalize` ran first)."""

    def __init__(self, hook) -> None:
        self.hook = hook

    def __call__(self, module, args, kwargs):
        out = self.hook(module, args[:1] if _taken(kwargs) else args)
        if out is None:
            return None
        return (out if isinstance(out, tuple) else (out,)), kwargs


class StockViewForwardHook:
    """A user's ``hook(module, args, output)``, given ``(norm(r'),)`` and the block's own output in a folded call."""

    def __init__(self, hook) -> None:
        self.hook = hook

    def __call__(self, module, args, kwargs, output):
        if not _taken(kwargs):
            return self.hook(module, args, output)
        new = self.hook(module, args[:1], output[0])
        return None if new is None else (new, output[1])
