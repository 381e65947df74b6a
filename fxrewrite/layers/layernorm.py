"""RMSNorm with an optional fused residual add, calling `fxrewrite.kernels.rms_norm`.

Formula (transformers `LlamaRMSNorm` / `Gemma2RMSNorm`): x̂ = x * rsqrt(mean(x², -1) + eps) in
float32; Llama form ``weight * x̂.to(dtype)``; Gemma form ``(x̂ * (1 + weight)).to(dtype)``
(``offset=1.0``). The weight is stored as the checkpoint stores it, so HF names and values load as is.
"""

from __future__ import annotations

import torch
from torch import nn

from fxrewrite.kernels import compiled_serving_kernels
from fxrewrite.kernels.rms_norm import rms_norm
from fxrewrite.kernels.rms_norm_backward import rms_norm_train
from fxrewrite.layers.gated_mlp import residual_norm_mlp
from fxrewrite.layers.hook_warning import WarnsOnHooks
from fxrewrite.layers.input_norm import normed_call
from fxrewrite.layers.residual_hooks import (ResidualTaken, stock_view_backward_hook, stock_view_backward_pre_hook,
                                             stock_view_forward_hook, stock_view_pre_hook, take_residual)


REWRITTEN_CALLS_ATTR = "_fxrewrite_rewritten_calls"
"""Instance attribute of a fused `RMSNorm` that its rewritten parent calls otherwise than transformers' code did
(`note_rewritten_call`): how, for the warning a hook registered on it afterwards gets."""


RESIDUAL_CALL_ATTR = "_fxrewrite_residual_call"
"""Instance attribute of a fused `RMSNorm` that the residual fold calls as ``norm(x, residual)``: how (hooks
registered on it afterwards are adapted to transformers' call, `fxrewrite.layers.residual_hooks`)."""

TAKES_RESIDUAL_ATTR = "_fxrewrite_takes_residual"
"""Instance attribute of such a norm once its first pre-hook forms x + residual (`take_residual`, for backward hooks)."""


def note_residual_call(norm: nn.Module, how: str) -> None:
    """Record on `norm` (an `RMSNorm`) that the residual fold calls it as ``norm(x, residual)``."""
    norm.__dict__[RESIDUAL_CALL_ATTR] = how


def note_rewritten_call(norm: nn.Module, how: str) -> None:
    """Record on `norm` (an `RMSNorm`) that a rewrite changed its calls: `how` says what a hook on it would see."""
    calls = norm.__dict__.setdefault(REWRITTEN_CALLS_ATTR, [])
    if how not in calls:
        calls.append(how)


class RMSNorm(WarnsOnHooks, nn.Module):
    """RMSNorm over the last dim: x [..., hidden_size] -> same shape and dtype.

    ``forward(x, residual)`` first sets residual = x + residual (in x's dtype, as the HF decoder
    layer does) and returns ``(norm(residual), residual)``; this is vLLM's fused-add form.
    ``upcast=False`` computes in the input dtype (for models whose norm does no float32 upcast).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, offset: float = 0.0, upcast: bool = True,
                 dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        if hidden_size <= 0:
            raise ValueError(f"hidden_size must be positive, got {hidden_size}")
        self.hidden_size, self.variance_epsilon = hidden_size, float(eps)
        self.offset, self.upcast = float(offset), upcast
        init = torch.zeros if offset else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=dtype or torch.get_default_dtype(), device=device))
        self.weight.weight_loader = self.weight_loader

    def forward(self, x: torch.Tensor, residual: torch.Tensor | ResidualTaken | None = None):
        """x [..., H]; residual None or like x. Returns out, or (out, x + residual). A `ResidualTaken` residual
        (a hook's view of the call, `fxrewrite.layers.residual_hooks`): (norm(x), that sum)."""
        if isinstance(residual, ResidualTaken):
            return self.forward(x), residual.tensor  # not self(x): the hooks ran for this call already
        if not self.upcast:
            return self._forward_no_upcast(x, residual)
        # While autograd records: the Triton forward/backward pair (torch reference off the GPU).
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad
                                                  or (residual is not None and residual.requires_grad))
        fn = rms_norm_train if needs_grad or compiled_serving_kernels(x) else rms_norm
        return fn(x, self.weight, self.variance_epsilon, residual, self.offset)

    def forward_mlp(self, x: torch.Tensor, residual: torch.Tensor, mlp: nn.Module):
        """(r + mlp(self(r)), r) with r = x + residual; x, residual [..., H]: a decoder layer's residual add, this
        norm, its MLP and the closing residual add in one call, fused where the MLP is a proven gated MLP
        (`fxrewrite.layers.gated_mlp.residual_norm_mlp`)."""
        return residual_norm_mlp(self, x, residual, mlp)

    def forward_into(self, module: nn.Module, *args, **kwargs):
        """``module(...)`` of this norm of its input (the keyword argument its QKV rewrite recorded, else the first
        positional one): where proven, the norm runs inside the module's qkv_proj
        (`fxrewrite.layers.input_norm.normed_call`)."""
        return normed_call(self, module, args, kwargs)

    def register_forward_pre_hook(self, hook, *, prepend: bool = False, with_kwargs: bool = False):
        """`nn.Module.register_forward_pre_hook`; on a norm the residual fold calls, the hook sees transformers' call
        (`fxrewrite.layers.residual_hooks`)."""
        adapt = self._residual_call()
        return self._registered(nn.Module.register_forward_pre_hook.__get__(self),
                                stock_view_pre_hook(hook, with_kwargs) if adapt else hook, adapted=adapt,
                                prepend=prepend, with_kwargs=with_kwargs)

    def register_forward_hook(self, hook, *, prepend: bool = False, with_kwargs: bool = False,
                              always_call: bool = False):
        """`nn.Module.register_forward_hook`, adapted as `register_forward_pre_hook`'s."""
        adapt = self._residual_call()
        return self._registered(nn.Module.register_forward_hook.__get__(self),
                                stock_view_forward_hook(hook, with_kwargs) if adapt else hook, adapted=adapt,
                                prepend=prepend, with_kwargs=with_kwargs, always_call=always_call)

    def register_full_backward_hook(self, hook, prepend: bool = False):
        """`nn.Module.register_full_backward_hook`, adapted as `register_forward_pre_hook`'s: the gradients of
        transformers' input and output."""
        adapt = self._residual_call(backward=True)
        return self._registered(nn.Module.register_full_backward_hook.__get__(self),
                                stock_view_backward_hook(hook) if adapt else hook, adapted=adapt, prepend=prepend)

    def register_full_backward_pre_hook(self, hook, prepend: bool = False):
        """`nn.Module.register_full_backward_pre_hook`, adapted as `register_full_backward_hook`'s."""
        adapt = self._residual_call(backward=True)
        return self._registered(nn.Module.register_full_backward_pre_hook.__get__(self),
                                stock_view_backward_pre_hook(hook) if adapt else hook, adapted=adapt,
                                prepend=prepend)

    def _residual_call(self, backward: bool = False) -> bool:
        """Whether the residual fold calls this norm (its hooks are then adapted). For a backward hook the norm's
        first pre-hook forms x + residual from then on (`take_residual`), so that the module's input is the sum."""
        folded = RESIDUAL_CALL_ATTR in self.__dict__
        if folded and backward and not self.__dict__.get(TAKES_RESIDUAL_ATTR):
            nn.Module.register_forward_pre_hook(self, take_residual(), prepend=True)
            self.__dict__[TAKES_RESIDUAL_ATTR] = True
        return folded

    def _hook_warning_text(self, adapted: bool = False) -> str | None:
        calls = list(self.__dict__.get(REWRITTEN_CALLS_ATTR, ()))
        if RESIDUAL_CALL_ATTR in self.__dict__ and not adapted:
            calls.insert(0, self.__dict__[RESIDUAL_CALL_ATTR])
        if not calls:
            return None
        return (f"a hook on this RMSNorm sees the calls fxrewrite.optimize rewrote, not transformers': "
                f"{'; '.join(calls)}. Register the hook before optimize to keep the norm's calls as they were")

    def _forward_no_upcast(self, x: torch.Tensor, residual: torch.Tensor | None):
        if residual is not None:
            x = x + residual
            residual = x
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = h * (self.offset + self.weight) if self.offset else self.weight * h
        return out if residual is None else (out, residual)

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id=None) -> None:
        """Copy the full weight [H] (norms are replicated under tensor parallelism)."""
        if loaded_shard_id is not None:
            raise ValueError(f"RMSNorm has no shards, got loaded_shard_id={loaded_shard_id!r}")
        if tuple(param.shape) != tuple(loaded_weight.shape):
            raise ValueError(f"weight shape {tuple(loaded_weight.shape)} does not match {tuple(param.shape)}")
        if param.device.type != "meta":
            with torch.no_grad():
                param.copy_(loaded_weight)

    def extra_repr(self) -> str:
        """Size, eps, offset and upcast in the module's repr."""
        return f"{self.hidden_size}, eps={self.variance_epsilon}, offset={self.offset}"


def plain_rms_norm_width(module: nn.Module) -> int | None:
    """The width of an RMSNorm over the last dim computing ``w * (x * rsqrt(mean(x²) + eps))`` in float32
    (fxrewrite's with upcast and no offset, or transformers' OLMoE-style ``*RMSNorm`` the fusion left); else None."""
    if type(module) is RMSNorm:
        return module.hidden_size if module.upcast and not module.offset else None
    name, weight = type(module).__name__, getattr(module, "weight", None)
    if (name.endswith("RMSNorm") and "Gemma" not in name and type(module).__module__.startswith("transformers.")
            and hasattr(module, "variance_epsilon") and isinstance(weight, nn.Parameter) and weight.dim() == 1):
        return weight.shape[0]
    return None
