"""Gated activations over the last dim: [..., 2*d] -> act(x[..., :d]) * x[..., d:], [..., d].

`SiluAndMul` and `GeluAndMul` call `fxrewrite.kernels.activation` (Triton on CUDA, torch
reference elsewhere); while autograd records, `fxrewrite.kernels.activation_backward` (Triton
forward + a backward that recomputes the activation; autograd through the reference off the GPU).
Formula: transformers `LlamaMLP` (act(gate) * up), vLLM `layers/activation.py` layout.
"""

from __future__ import annotations

import torch
from torch import nn

from fxrewrite.kernels.activation import gelu_and_mul, silu_and_mul
from fxrewrite.kernels.activation_backward import act_and_mul_train


def _needs_grad(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


class SiluAndMul(nn.Module):
    """x [..., 2*d] -> silu(x[..., :d]) * x[..., d:]; ValueError on an odd last dim."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2*d] -> [..., d] in x's dtype; ValueError on an odd last dim."""
        return act_and_mul_train(x, "silu") if _needs_grad(x) else silu_and_mul(x)


class GeluAndMul(nn.Module):
    """x [..., 2*d] -> gelu(x[..., :d], approximate) * x[..., d:]; approximate "none" or "tanh"."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2*d] -> [..., d] in x's dtype; ValueError on an odd last dim."""
        if _needs_grad(x):
            return act_and_mul_train(x, "gelu_tanh" if self.approximate == "tanh" else "gelu")
        return gelu_and_mul(x, self.approximate)

    def extra_repr(self) -> str:
        """``approximate=...`` in the module's repr."""
        return f"approximate={self.approximate!r}"
