"""Gated activations over the last dim: [..., 2*d] -> act(x[..., :d]) * x[..., d:], [..., d].

`SiluAndMul` and `GeluAndMul` call `fxrewrite.kernels.activation` (Triton on CUDA, torch
reference elsewhere); while autograd records, `fxrewrite.kernels.activation_backward` (Triton
forward + a backward that recomputes the activation; autograd through the reference off the GPU).
Formula: transformers `LlamaMLP` (act(gate) * up), vLLM `layers/activation.py` layout.
"""

from __future__ import annotations

import torch
from torch import nn

from fxrewrite.kernels import compiled_serving_kernels, compiled_training_kernels, use_triton
from fxrewrite.kernels.activation import gelu_and_mul, silu_and_mul
from fxrewrite.kernels.activation_backward import act_and_mul_train
from fxrewrite.kernels.batch_invariant import is_batch_invariant
from fxrewrite.kernels.gated_mlp_down import act_and_mul_down_train
from fxrewrite.layers.fold_guard import unhooked
from fxrewrite.signature import SOURCE_ACT_ATTR


def _needs_grad(x: torch.Tensor) -> bool:
    """Autograd records, or a compiled forward takes the Triton op (`compiled_serving_kernels`)."""
    return torch.is_grad_enabled() and x.requires_grad or compiled_serving_kernels(x)


def _fused_down(x: torch.Tensor, down: nn.Module | None) -> bool:
    """Whether ``down(act(x))`` may run as one Function that does not save act(x) (`act_and_mul_down_train`):
    autograd records, the Triton kernels run (eager, or as custom ops under torch.compile), and ``down`` is a plain ``nn.Linear`` of this dtype
    without hooks of its own, backward ones included, or a forward put on its instance (`unhooked`: a LoRA wrapper, a
    sharded or hooked layer is called as it is), outside batch-invariant mode."""
    return (down is not None and type(down) is nn.Linear and torch.is_grad_enabled() and x.requires_grad
            and unhooked(down) and down.weight.dtype == x.dtype
            and (use_triton(x) or compiled_training_kernels(x)) and not is_batch_invariant())  # batch-invariant: down as the engine runs it


def replaced_activation(layer: nn.Module) -> nn.Module | None:
    """The module to call in place of `layer`'s fused activation, else None: the MLP's activation child that the
    rewrite replaced (`SOURCE_ACT_ATTR`: the MLP, the child's name, the child), when a hook or a forward of its own
    instance is on it (or a global module hook is set), or another module now in its place (``mlp.act_fn = ...`` after `optimize`): it then runs
    on the gate half, as the stock forward calls it."""
    held = layer.__dict__.get(SOURCE_ACT_ATTR)
    if held is None:
        return None
    mlp, name, source = held
    current = getattr(mlp, name)  # AttributeError, as the stock forward's, when deleted since
    return current if current is not source or not unhooked(source) else None


class _GatedActivation(nn.Module):
    """``forward(x, down=None)``: ``act(x)``, or ``down(act(x))`` when the rewrite passes the MLP's
    down projection (then, while training, act(x) is recomputed in the backward instead of saved)."""

    act = "silu"
    inplace_backward = False

    def forward(self, x: torch.Tensor, down: nn.Module | None = None) -> torch.Tensor:
        """x [..., 2*d] -> [..., d] in x's dtype (or ``down`` of it); ValueError on an odd last dim."""
        source = replaced_activation(self)
        if source is not None:  # the user's hook or module in place of the fused-away activation runs, on the gate half
            gate, up = x.chunk(2, dim=-1)
            y = source(gate) * up
            return y if down is None else down(y)
        if _fused_down(x, down):
            return act_and_mul_down_train(x, down.weight, down.bias, self.act, self.inplace_backward)
        y = self._act(x)
        return y if down is None else down(y)


class SiluAndMul(_GatedActivation):
    """x [..., 2*d] -> silu(x[..., :d]) * x[..., d:]; ValueError on an odd last dim.

    ``inplace_backward=True`` (set by the gated-MLP rewrite, whose fused gate_up output only this layer
    reads): the training backward writes x's gradient over x, as Liger-Kernel's SwiGLU does; a forward hook
    that keeps gate_up_proj's output would see it overwritten after the backward.
    """

    def __init__(self, inplace_backward: bool = False) -> None:
        super().__init__()
        self.inplace_backward = inplace_backward

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        return act_and_mul_train(x, "silu", self.inplace_backward) if _needs_grad(x) else silu_and_mul(x)


class GeluAndMul(_GatedActivation):
    """x [..., 2*d] -> gelu(x[..., :d], approximate) * x[..., d:]; approximate "none" or "tanh";
    ``inplace_backward`` as in `SiluAndMul`."""

    def __init__(self, approximate: str = "none", inplace_backward: bool = False) -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate, self.inplace_backward = approximate, inplace_backward
        self.act = "gelu_tanh" if approximate == "tanh" else "gelu"

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        if _needs_grad(x):
            return act_and_mul_train(x, "gelu_tanh" if self.approximate == "tanh" else "gelu", self.inplace_backward)
        return gelu_and_mul(x, self.approximate)

    def extra_repr(self) -> str:
        """``approximate=...`` in the module's repr."""
        return f"approximate={self.approximate!r}, inplace_backward={self.inplace_backward}"
