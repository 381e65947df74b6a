"""A decoder layer's ``residual add + norm -> gated MLP -> residual add`` as one call, for rewritten transformers
layers (`fxrewrite.patterns.rms_norm.ResidualRMSNormPattern`): ``x, r = self.post_attention_layernorm.forward_mlp(e,
r, self.mlp)`` computes what ``x = r + e; r = x; x = norm(x); x = mlp(x); x = r + x`` did.

At decode token counts the norm runs inside gate_up_proj's skinny GEMV (`LinearBase.norm_forward`, kind "norm")
and the closing add in down_proj's epilogue (`LinearBase.silu_forward` with ``out_residual``), as the native
decoder layers fuse them: two launches a layer fewer. That path calls the MLP's children directly, so it runs
only where the gated-MLP rewrite proved the MLP's whole forward to be ``down(act(gate_up(x)))``
(`GATED_MLP_ATTR`), the forward is still the one fxrewrite bound, no hook is on the norm, the MLP or its children, and
autograd, autocast and torch.compile's tracing are off (training keeps the MLP's own forward, with its fused
activation backward; Inductor sees the plain ops); otherwise the unfused ops run in the original order.
"""

from __future__ import annotations

import torch
from torch import nn

from fxrewrite.layers.activation import replaced_activation
from fxrewrite.layers.fold_guard import fused_call_allowed, runs_bound_forward, unhooked

__all__ = ["GATED_MLP_ATTR", "residual_norm_mlp"]

GATED_MLP_ATTR = "_fxrewrite_gated_mlp"
"""Instance attribute of a module whose forward the gated-MLP rewrite proved to be exactly
``down(act(gate_up(x)))``: the names (gate_up, act, down) of those children (`fxrewrite.patterns.glu`)."""

def _children(norm: nn.Module, mlp: nn.Module, x: torch.Tensor):
    """(gate_up, act, down) when the fused path may replace ``norm(...)`` and ``mlp(...)`` for this call, else
    None."""
    names = mlp.__dict__.get(GATED_MLP_ATTR)
    if names is None or not fused_call_allowed(x) or not runs_bound_forward(mlp):
        return None
    children = [mlp._modules.get(name) for name in names]
    if any(c is None for c in children) or not hasattr(children[0], "norm_forward"):  # e.g. wrapped since
        return None
    # the activation module the fused one replaced, hooked or swapped since: the MLP's own forward calls it
    return children if unhooked(norm, mlp, *children) and replaced_activation(children[1]) is None else None


def residual_norm_mlp(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor, mlp: nn.Module):
    """(out, r) with r = x + residual (rounded to x's dtype) and out = r + mlp(norm(r)); x, residual [..., H].

    `norm` is a fused `RMSNorm` (``norm(x, residual) -> (norm(r), r)``). The gate_up / down fusions apply as the
    module docstring says, with the unfused ops' roundings (the sums in the skinny GEMV's order, as in any decode
    step it serves)."""
    children = _children(norm, mlp, x)
    if children is None:
        h, residual = norm(x, residual)
        return residual + mlp(h), residual
    gate_up, act, down = children
    h, residual = gate_up.norm_forward(x, norm, residual)
    if hasattr(down, "silu_forward"):
        return down.silu_forward(h, act, out_residual=residual), residual
    return residual + down(act(h)), residual
