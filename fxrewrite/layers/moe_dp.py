"""MoE layers across data-parallel replicas (vLLM's DP attention + EP MoE; `fxrewrite.data_parallel`).

Each replica runs attention on its own requests; at every MoE layer the replicas' tokens meet:
1. all-gather the hidden states over the DP group (same TP rank of every replica), padded to the
   largest replica's token count (collectives need equal sizes), then the padding is dropped;
2. every worker routes all gathered tokens (the router is replicated) and runs its own experts,
   E / (dp x tp) whole experts, on them: slots routed elsewhere contribute zero;
3. the partial outputs are summed over the EP group (every worker), and each replica keeps its rows.
A replica with no work this step still calls every MoE layer with zero tokens (`run_idle`), so the
collectives line up (vLLM runs a dummy batch for the same reason).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fxrewrite import data_parallel
from fxrewrite.kernels.fused_moe import select_experts


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
    counts = token_counts(x.shape[0], x.device)
    longest = max(counts)
    if longest == 0:
        return x.new_zeros(x.shape)
    padded = F.pad(x, (0, 0, 0, longest - x.shape[0])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(state.dp_size)]
    dist.all_gather(parts, padded, group=state.dp_group)
    tokens = torch.cat([p[:n] for p, n in zip(parts, counts)])
    router, experts = moe._child("router"), moe._child("experts")
    logits = F.linear(tokens, router.weight, getattr(router, "bias", None))
    weights, ids = select_experts(logits, moe.top_k, moe.renormalize, moe.scoring_func)
    out = experts(tokens, weights, ids)
    dist.all_reduce(out, group=state.ep_group)
    start = sum(counts[: state.dp_rank])
    return out[start: start + x.shape[0]]
