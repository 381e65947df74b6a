"""RMSNorm over a width split across tensor-parallel ranks (OLMoE's q/k norm over all heads).

OLMoE normalises q (and k) over all heads at once: ``x * rsqrt(mean(x², over Hq*D) + eps) * w``
(transformers ``OlmoeAttention``: ``q_norm(q_proj(x))`` before the head split). Under tensor
parallelism each rank holds only its heads, so the mean of squares is ``all_reduce(sum of local
x²) / (full width * replicas)``, where ``replicas`` counts ranks holding the same heads (k/v heads
replicated when there are fewer kv heads than ranks). The weight is this rank's slice of the full one.
"""

from __future__ import annotations

import torch
from torch import nn

from fxrewrite.distributed import tensor_model_parallel_all_reduce


class ShardedRMSNorm(nn.Module):
    """x [..., local width] -> same shape and dtype; weight [local width] (float32 statistics).

    ``offset`` is this rank's start in the full weight; ValueError if the slice is out of range.
    """

    def __init__(self, full_size: int, local_size: int, offset: int, replicas: int, eps: float,
                 dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        if offset < 0 or offset + local_size > full_size:
            raise ValueError(f"slice [{offset}, {offset + local_size}) is outside a norm of width {full_size}")
        self.full_size, self.local_size, self.offset, self.replicas = full_size, local_size, offset, replicas
        self.variance_epsilon = float(eps)
        self.weight = nn.Parameter(torch.ones(local_size, dtype=dtype or torch.get_default_dtype(), device=device))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id=None) -> None:
        """Copy this rank's slice of the full weight [full_size]."""
        if tuple(loaded_weight.shape) != (self.full_size,):
            raise ValueError(f"norm weight shape {tuple(loaded_weight.shape)} != ({self.full_size},)")
        if param.device.type != "meta":
            with torch.no_grad():
                param.copy_(loaded_weight.narrow(0, self.offset, self.local_size))

    def full_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        """The checkpoint's shape of the weight (what in-place weight sync sends): the full width."""
        return (self.full_size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        square_sum = tensor_model_parallel_all_reduce(h.pow(2).sum(-1, keepdim=True))
        variance = square_sum / (self.full_size * self.replicas)
        return self.weight * (h * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.local_size} of {self.full_size} (offset {self.offset}), eps={self.variance_epsilon}"
