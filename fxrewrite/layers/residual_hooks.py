"""Hooks on a fused `RMSNorm` that see transformers' call, not the rewrite's.

The residual fold (`fxrewrite.patterns.rms_norm`) calls a decoder layer's norm as ``norm(x, residual)`` returning
``(norm(x + residual), x + residual)``; transformers' layer calls ``norm(x + residual)`` returning the normed tensor.
A hook registered on the norm after `optimize` is wrapped so that it sees the latter:
- a forward pre-hook gets ``(x + residual,)`` (and the kwargs, ``with_kwargs``) and may replace it (the residual
  stream keeps ``x + residual``, as in transformers, where the residual is taken before the norm's call);
- a forward hook gets that input and the normed output and may replace the output;
- a full backward hook gets the gradient of that input and of the normed output (the residual's gradient, which in
  transformers bypasses the norm, is left out) and may replace the former; a backward pre-hook gets the normed
  output's gradient and may replace it. For these the norm first forms ``x + residual`` in a pre-hook of its own
  (`take_residual`), so that the module's input is the sum and the residual stream leaves the call beside it.
A fresh user's finds: ``args[0] + 1`` in a pre-hook had changed the attention output before the add (silently other
numbers), ``out * 2`` in a forward hook broke the layer with an unpacking error, a backward hook scaling its input
gradient also scaled the residual stream's.
"""

from __future__ import annotations

import torch

__all__ = ["ResidualTaken", "stock_view_backward_hook", "stock_view_backward_pre_hook", "stock_view_forward_hook",
           "stock_view_pre_hook", "take_residual"]


class ResidualTaken:
    """The second argument of a norm call whose pre-hook already formed ``x + residual`` (`tensor`): the first
    argument is then the (maybe replaced) norm input, and the call returns ``(norm(input), tensor)``."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _folded(args: tuple) -> bool:
    return len(args) == 2 and args[1] is not None


def _unchanged(module, args):
    return None


class stock_view_pre_hook:  # noqa: N801 (a function by use; a class so that a model holding it still pickles)
    """`hook(module, args)` (``with_kwargs``: `hook(module, args, kwargs)`) as transformers' call gives it, for a
    norm also called as ``norm(x, residual)``."""

    def __init__(self, hook, with_kwargs: bool = False) -> None:
        self.hook, self.with_kwargs = hook, with_kwargs

    def __call__(self, module, args, *kwargs):
        if not _folded(args):
            return self.hook(module, args, *kwargs)
        taken = args[1] if isinstance(args[1], ResidualTaken) else ResidualTaken(args[0] + args[1])
        x = args[0] if isinstance(args[1], ResidualTaken) else taken.tensor
        out = self.hook(module, (x,), *kwargs)
        if self.with_kwargs:
            new_args, new_kwargs = out if out is not None else ((x,), kwargs[0])
            return (new_args[0], taken), new_kwargs
        if out is not None:
            x = out[0] if isinstance(out, tuple) else out
        return (x, taken)


def take_residual() -> stock_view_pre_hook:
    """A pre-hook that forms ``x + residual`` before the call and changes nothing else: registered first on a norm
    with backward hooks, it makes the sum the module's input (module docstring)."""
    return stock_view_pre_hook(_unchanged)


class stock_view_forward_hook:  # noqa: N801 (as stock_view_pre_hook)
    """`hook(module, args, output)` (``with_kwargs``: `hook(module, args, kwargs, output)`) as transformers' call gives
    it, for a norm also called as ``norm(x, residual)``."""

    def __init__(self, hook, with_kwargs: bool = False) -> None:
        self.hook, self.with_kwargs = hook, with_kwargs

    def __call__(self, module, args, *rest):
        if not _folded(args):
            return self.hook(module, args, *rest)
        output = rest[-1]
        x = args[0] if isinstance(args[1], ResidualTaken) else output[1]
        out = self.hook(module, (x,), *rest[:-1], output[0])
        return None if out is None else (out, output[1])


class stock_view_backward_hook:  # noqa: N801 (as stock_view_pre_hook)
    """`hook(module, grad_input, grad_output)` as transformers' call gives it: under `take_residual` a folded call's
    inputs are the sum and a `ResidualTaken` (grad_input (sum's, None)), its outputs the normed tensor and the
    residual stream: the hook gets the first of each, its replacement goes back in the first place."""

    def __init__(self, hook) -> None:
        self.hook = hook

    def __call__(self, module, grad_input, grad_output):
        out = self.hook(module, grad_input[:1], grad_output[:1])
        if out is None or len(grad_input) == 1:
            return out
        return ((out[0] if isinstance(out, (tuple, list)) else out), *grad_input[1:])


class stock_view_backward_pre_hook:  # noqa: N801 (as stock_view_pre_hook)
    """`hook(module, grad_output)` as transformers' call gives it: the normed output's gradient alone; a replaced one
    goes back with the residual stream's unchanged."""

    def __init__(self, hook) -> None:
        self.hook = hook

    def __call__(self, module, grad_output):
        out = self.hook(module, grad_output[:1])
        if out is None or len(grad_output) == 1:
            return out
        return ((out[0] if isinstance(out, (tuple, list)) else out), *grad_output[1:])
