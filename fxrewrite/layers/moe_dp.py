"""MoE layers across data-parallel replicas (vLLM's DP attention + EP MoE; `fxrewrite.data_parallel`).

Each replica runs attention on its own requests; at every MoE layer the replicas' tokens meet:
1. all-gather the hidden states over the DP group (same TP rank of every replica), each replica's
   rows padded to L, the largest replica's token count (collectives need equal sizes);
2. every worker routes all gathered rows (the router is replicated) and runs its own experts,
   E / (dp x tp) whole experts, on them: slots routed elsewhere, and padding rows, contribute zero;
3. the partial outputs are summed over every worker and each replica keeps its rows: a
   reduce-scatter over the DP group (replica d receives rows [d*L, (d+1)*L) summed over the replicas),
   then, at tp > 1, an all-reduce over the replica's TP group (the TP ranks hold different experts).
   Sum over DP then TP is the sum over the EP group, with 1/dp of the all-reduce's traffic.
Two ways to know L:
- eager steps: the worker notes every replica's token count before the step (`token_counts`); a
  replica with no work still calls every MoE layer with zero tokens (`run_idle` in the worker);
- CUDA graphs (`data_parallel.uniform_tokens()`, set while decode graphs are captured): every replica
  calls with the same number of rows, its graph bucket, so L is x's row count and nothing depends on
  the step; at a decode wave the worker pads every replica, idle ones included, to one bucket.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fxrewrite import data_parallel
from fxrewrite.distributed import tensor_model_parallel_all_reduce
from fxrewrite.kernels.fused_moe import select_experts

# torch renamed the flat-tensor collectives (same signatures); the old names warn on newer versions.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def token_counts(num_tokens: int, device: torch.device) -> list[int]:
    """Every replica's token count this step: the worker's note, else an all-gather over the DP group
    (the memory profiler's forward, where every replica runs the same dummy batch)."""
    state = data_parallel.get_state()
    if state.step_token_counts is not None:
        counts = state.step_token_counts
        if counts[state.dp_rank] != num_tokens:
            raise RuntimeError(f"MoE layer got {num_tokens} tokens, the step announced "
                               f"{counts[state.dp_rank]} for data-parallel rank {state.dp_rank}")
        return counts
    mine = torch.tensor([num_tokens], dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(state.dp_size)]
    dist.all_gather(parts, mine, group=state.dp_group)
    return [int(p) for p in parts]


def experts_across_dp(moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The routed experts' output for this replica's tokens x [T, H] (T may be 0), summed over every
    worker's experts; same dtype as x. `moe` is a `FusedMoE` (its router, experts, top-k settings)."""
    state = data_parallel.get_state()
    if state.uniform_tokens:
        counts = [x.shape[0]] * state.dp_size
    else:
        counts = token_counts(x.shape[0], x.device)
    longest = max(counts)
    if longest == 0:
        return x.new_zeros(x.shape)
    padded = F.pad(x, (0, 0, 0, longest - x.shape[0])).contiguous()
    tokens = padded.new_empty(state.dp_size * longest, x.shape[1])
    _all_gather(tokens, padded, group=state.dp_group)
    router, experts = moe._child("router"), moe._child("experts")
    logits = F.linear(tokens, router.weight, getattr(router, "bias", None))
    weights, ids = select_experts(logits, moe.top_k, moe.renormalize, moe.scoring_func)
    if any(n < longest for n in counts):  # padding rows route nowhere (-1: no rank holds it), cost nothing
        real = torch.cat([torch.arange(longest, device=x.device) < n for n in counts])
        ids = torch.where(real[:, None], ids, -1)
    out = experts(tokens, weights, ids)
    return tensor_model_parallel_all_reduce(_sum_my_rows(out, longest, state))[: x.shape[0]]


_gloo_reduce_scatter = True
"""Whether gloo's reduce-scatter works here (some torch versions lack it for CPU tensors)."""


def _sum_my_rows(out: torch.Tensor, longest: int, state) -> torch.Tensor:
    """Rows [dp_rank*L, (dp_rank+1)*L) of `out` [dp*L, H] summed over the DP group: a reduce-scatter,
    or where gloo lacks one an all-reduce and a slice."""
    global _gloo_reduce_scatter
    mine = out.new_empty(longest, out.shape[1])
    gloo = dist.get_backend(state.dp_group) == "gloo"
    if not gloo or _gloo_reduce_scatter:
        try:
            _reduce_scatter(mine, out, group=state.dp_group)
            return mine
        except RuntimeError:  # gloo without the op: raised before any traffic, the same on every rank
            if not gloo:
                raise
            _gloo_reduce_scatter = False
    dist.all_reduce(out, group=state.dp_group)
    return out[state.dp_rank * longest: (state.dp_rank + 1) * longest]
