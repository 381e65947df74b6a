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
The steps are public (`replica_counts`, `gather_rows`, `real_rows`, `sum_to_replica`): transformers' own experts
modules left unfused take them too, their router run on the replica's own tokens first, so the replicas gather
(hidden states, top-k ids, top-k weights) instead (`fxrewrite.sharding_moe.ExpertsAcrossReplicas`).
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


def replica_counts(num_tokens: int, device: torch.device) -> list[int]:
    """Every replica's row count at this MoE call: `num_tokens` for all under `data_parallel.uniform_tokens()`
    (CUDA graph buckets: nothing read from the host), else `token_counts`. RuntimeError: see `token_counts`."""
    state = data_parallel.get_state()
    if state.uniform_tokens:
        return [num_tokens] * state.dp_size
    return token_counts(num_tokens, device)


def gather_rows(x: torch.Tensor, counts: list[int], pad_value: float = 0) -> torch.Tensor:
    """x [T, ...] (T = counts[dp_rank]) of every replica, each padded with `pad_value` to L = max(counts) rows:
    [dp * L, ...] (replica d's rows at [d*L, d*L + counts[d])), same dtype; an all-gather over the DP group,
    so every replica must call it with the same dtype and trailing shape."""
    state = data_parallel.get_state()
    longest = max(counts)
    padded = F.pad(x, (0, 0) * (x.dim() - 1) + (0, longest - x.shape[0]), value=pad_value).contiguous()
    out = padded.new_empty(state.dp_size * longest, *x.shape[1:])
    _all_gather(out, padded, group=state.dp_group)
    return out


def real_rows(counts: list[int], device: torch.device) -> torch.Tensor | None:
    """bool [dp * L]: which rows of `gather_rows`' result are a replica's tokens (False: padding); None when
    no replica was padded."""
    longest = max(counts)
    if all(n == longest for n in counts):
        return None
    return torch.cat([torch.arange(longest, device=device) < n for n in counts])


def sum_to_replica(out: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """This replica's rows of `out` [dp * L, H] (every worker's partial result on the gathered rows), summed over
    every worker: a reduce-scatter over the DP group, then an all-reduce over the replica's TP group (its ranks
    hold different experts); [num_tokens, H], same dtype."""
    state = data_parallel.get_state()
    longest = out.shape[0] // state.dp_size
    return tensor_model_parallel_all_reduce(_sum_my_rows(out, longest, state))[:num_tokens]


def experts_across_dp(moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The routed experts' output for this replica's tokens x [T, H] (T may be 0), summed over every
    worker's experts; same dtype as x. `moe` is a `FusedMoE` (its router, experts, top-k settings)."""
    counts = replica_counts(x.shape[0], x.device)
    if max(counts) == 0:
        return x.new_zeros(x.shape)
    tokens = gather_rows(x, counts)
    router, experts = moe._child("router"), moe._child("experts")
    logits = F.linear(tokens, router.weight, getattr(router, "bias", None))
    weights, ids = select_experts(logits, moe.top_k, moe.renormalize, moe.scoring_func)
    weights = moe.round_routing_weights(weights, tokens)
    real = real_rows(counts, x.device)
    if real is not None:  # padding rows route nowhere (-1: no rank holds it), cost nothing
        ids = torch.where(real[:, None], ids, -1)
    return sum_to_replica(experts(tokens, ids, weights), x.shape[0])


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
