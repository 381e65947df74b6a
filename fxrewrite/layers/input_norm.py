"""A decoder layer's input RMSNorm applied inside its attention's fused QKV projection, for rewritten transformers
layers (`fxrewrite.patterns.input_norm`): ``x = self.input_layernorm(x); x, _ = self.self_attn(hidden_states=x,
...)`` becomes ``x, _ = self.input_layernorm.forward_into(self.self_attn, hidden_states=x, ...)``.

At decode token counts the norm then runs inside qkv_proj's skinny GEMV (`LinearBase.norm_forward`, kind "norm"), as
the native decoder layers do: one launch a layer fewer. The attention module is called with the un-normalised input
and its qkv_proj told to normalise what it reads (`QKVParallelLinear.forward` takes the norm left for it); that is
only right where the QKV rewrite proved the attention reads that input through the q/k/v projections alone
(`NORMED_INPUT_ATTR`), so the fused path runs only there, while the attention and qkv_proj still run the forwards
fxrewrite bound or built, no hook is on the norm, the attention or qkv_proj, and autograd, autocast and
torch.compile's tracing are off. Otherwise the norm runs first, as before the rewrite.
"""

from __future__ import annotations

import torch
from torch import nn

from fxrewrite.layers.fold_guard import fused_call_allowed, runs_bound_forward, unhooked
from fxrewrite.layers.fp8_linear import Fp8LinearMixin
from fxrewrite.layers.linear import PENDING_NORM_ATTR, QKVParallelLinear

__all__ = ["NORMED_INPUT_ATTR", "normed_call"]

_TAKES_PENDING_NORM = (QKVParallelLinear.forward, Fp8LinearMixin.forward)

NORMED_INPUT_ATTR = "_fxrewrite_normed_input"
"""Instance attribute of an attention module whose forward reads its input only through its fused QKV projection
(`fxrewrite.patterns.qkv`): (the input's parameter name, the QKV child's name, the parameter's position after self)."""


def _fused_qkv(norm: nn.Module, module: nn.Module, x: torch.Tensor):
    """The QKV child when the fused path may run for this call, else None."""
    spec = module.__dict__.get(NORMED_INPUT_ATTR)
    if spec is None or not fused_call_allowed(x) or not runs_bound_forward(module):
        return None
    qkv = module._modules.get(spec[1])
    # a forward that takes the pending norm (QKVParallelLinear's, or its FP8 form's); not a wrapped or patched one
    if not isinstance(qkv, QKVParallelLinear) or type(qkv).forward not in _TAKES_PENDING_NORM \
            or "forward" in qkv.__dict__:
        return None
    return qkv if unhooked(norm, module, qkv) else None


def normed_call(norm: nn.Module, module: nn.Module, args: tuple, kwargs: dict):
    """``module(*args, **kwargs)`` with `norm` applied to its input first: the keyword argument named in
    `NORMED_INPUT_ATTR`, or the first positional one when that parameter is the first. In the fused path the norm runs
    in the module's qkv_proj. TypeError when the call does not pass that parameter so; RuntimeError if the attention
    returned without its qkv_proj taking the norm (a forward the proof did not see)."""
    spec = module.__dict__.get(NORMED_INPUT_ATTR)
    if spec is None:
        raise TypeError(f"{type(module).__name__} has no proven input for a folded norm ({NORMED_INPUT_ATTR})")
    name, _, position = spec
    positional = name not in kwargs
    if positional and (position != 0 or not args):
        raise TypeError(f"{type(module).__name__}: the call passes no {name!r} argument (by keyword, or first) to "
                        "normalise")
    x = args[0] if positional else kwargs[name]
    qkv = _fused_qkv(norm, module, x)
    if qkv is None:
        if positional:
            return module(norm(x), *args[1:], **kwargs)
        return module(*args, **{**kwargs, name: norm(x)})
    qkv.__dict__[PENDING_NORM_ATTR] = norm
    try:
        out = module(*args, **kwargs)
    finally:
        left = qkv.__dict__.pop(PENDING_NORM_ATTR, None)
    if left is not None:
        raise RuntimeError(f"{type(module).__name__}: its {spec[1]} did not run, so the input norm folded into it was "
                           "not applied")
    return out
