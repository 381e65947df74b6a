"""Forward hooks on a fused `RMSNorm` that see transformers' call, not the rewrite's.

The residual fold (`fxrewrite.patterns.rms_norm`) calls a decoder layer's norm as ``norm(x, residual)`` returning
``(norm(x + residual), x + residual)``; transformers' layer calls ``norm(x + residual)`` returning the normed tensor.
A forward (pre-)hook registered on the norm after `optimize` is wrapped so that it sees the latter: the pre-hook gets
``(x + residual,)`` and may replace it (the residual stream keeps ``x + residual``, as in transformers, where the
residual is taken before the norm's call), the forward hook gets that input and the normed output and may replace
the output. A fresh user's find: ``args[0] + 1`` in a pre-hook had changed the attention output before the add
(silently other numbers), ``out * 2`` in a forward hook broke the layer with an unpacking error.
"""

from __future__ import annotations

import torch

__all__ = ["ResidualTaken", "stock_view_forward_hook", "stock_view_pre_hook"]


class ResidualTaken:
    """The second argument of a norm call whose pre-hook already formed ``x + residual`` (`tensor`): the first
    argument is then the (maybe replaced) norm input, and the call returns ``(norm(input), tensor)``."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _folded(args: tuple) -> bool:
    return len(args) == 2 and args[1] is not None


class stock_view_pre_hook:  # noqa: N801 (a function by use; a class so that a model holding it still pickles)
    """`hook(module, args)` as transformers' call gives it, for a norm also called as ``norm(x, residual)``."""

    def __init__(self, hook) -> None:
        self.hook = hook

    def __call__(self, module, args):
        if not _folded(args):
            return self.hook(module, args)
        taken = args[1] if isinstance(args[1], ResidualTaken) else ResidualTaken(args[0] + args[1])
        x = args[0] if isinstance(args[1], ResidualTaken) else taken.tensor
        out = self.hook(module, (x,))
        if out is not None:
            x = out[0] if isinstance(out, tuple) else out
        return (x, taken)


class stock_view_forward_hook:  # noqa: N801 (as stock_view_pre_hook)
    """`hook(module, args, output)` as transformers' call gives it, for a norm also called as ``norm(x, residual)``."""

    def __init__(self, hook) -> None:
        self.hook = hook

    def __call__(self, module, args, output):
        if not _folded(args):
            return self.hook(module, args, output)
        x = args[0] if isinstance(args[1], ResidualTaken) else output[1]
        out = self.hook(module, (x,), output[0])
        return None if out is None else (out, output[1])
