"""log_softmax over the vocabulary in float32, accurate on a CPU too: the engine's logprobs and a trainer's.

Why: aten's CPU log_softmax kernel sums exp(x - max) along a row in SIMD lanes, one element after another,
in the input's dtype. In float32 over a large vocabulary with a trained model's spread of logits the sum
drifts: against float64, the error of a logprob measured 1.6e-5 at V = 49,152 (SmolLM2) and 4.6e-5 at
V = 151,936 (Qwen3) for logits of standard deviation 4, while `torch.logsumexp` (a cascade sum) stays near
2e-6. The engine's sampled-token logprobs then differ from a trainer's chunked log-sum-exp recomputation by
more than 1e-5 in float32 although both models compute the same logits. So on a CPU the row is normalised
in float64 (the same per-row kernel, so a row's result still does not depend on the other rows) and
rounded once to float32. CUDA's kernel reduces each row in a tree within a block and is accurate in
float32, so there the float32 call runs unchanged (and `batch_invariant_mode` still intercepts it).
"""

from __future__ import annotations

import torch

__all__ = ["log_softmax_float32"]

CPU_CHUNK_ELEMENTS = 1 << 22
"""Rows are normalised on a CPU in chunks of at most this many elements (32 MiB in float64)."""


def log_softmax_float32(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim of x [..., V] (any float dtype) -> float32 [..., V], differentiable.

    On a CPU each row goes through float64 (see the module docstring), in row chunks of at most
    `CPU_CHUNK_ELEMENTS`; elsewhere ``torch.log_softmax(x.float(), -1)``. Errors: torch's, for a 0-d x."""
    if x.device.type != "cpu":
        return torch.log_softmax(x.float(), dim=-1)
    if x.numel() == 0:
        return torch.log_softmax(x.float(), dim=-1)
    rows = x.reshape(-1, x.shape[-1])
    per_chunk = max(1, CPU_CHUNK_ELEMENTS // rows.shape[1])
    parts = [torch.log_softmax(part.double(), dim=-1).float() for part in rows.split(per_chunk)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(x.shape)
