"""Fused mixture-of-experts: routing top-k, token alignment by expert, grouped GEMMs with SiLU-and-mul.

The computation (transformers' experts modules, e.g. ``Qwen3MoeExperts``)::

    out[t] = sum_k w[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = ids[t, k]
    with w13[e] = [gate_e | up_e] of shape [2I, H] and w2[e] of shape [H, I].

`fused_experts_ref` is the specification (one matmul pair per expert, torch ops, differentiable).
`fused_experts` runs the Triton path on CUDA (or the interpreter, for tests): the T*K (token,
expert) slots are sorted by expert and padded per expert to a multiple of the GEMM row block
(`moe_align_block_size`, static shapes: no host sync, CUDA-graph safe), then one grouped GEMM
gathers rows of x per block of slots against that block's expert weights with SiLU-and-mul in its
epilogue, and a second one applies w2 and the routing weight. The backward pass reuses the grouped
GEMM (weights read transposed through strides) for the input gradients; the weight gradients are
per-expert matmuls over the sorted slots. Design facts from vLLM's
``vllm/model_executor/layers/fused_moe/fused_moe.py`` (sorted-token grouped GEMM, per-block expert
id, routed weight applied in the second GEMM); the code is our own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxrewrite.kernels import use_triton
from fxrewrite.kernels.fused_moe_triton import grouped_gemm

__all__ = ["select_experts", "moe_align_block_size", "fused_experts", "fused_experts_ref"]

SCORING = ("softmax", "sigmoid")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str = "softmax",
                   out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, top_k] float32 or `out_dtype`, topk_ids [T, top_k] int64).

    Scores are softmax (or sigmoid) over experts in float32, the top_k largest are kept, and with
    `renormalize` divided by their sum (transformers' ``norm_topk_prob``). ValueError when top_k
    is not in [1, E] or scoring_func is unknown.
    """
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts})")
    if scoring_func not in SCORING:
        raise ValueError(f"scoring_func={scoring_func!r}, expected one of {SCORING}")
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if scoring_func == "softmax" else logits.sigmoid()
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if out_dtype is None else weights.to(out_dtype)), ids


def fused_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, expert_start: int = 0) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights/ids [T, K] -> [T, H] in x's dtype.

    Experts ``expert_start .. expert_start + E - 1`` are the ones held here (expert parallelism);
    slots routed elsewhere contribute nothing. Differentiable in x, w13, w2 and topk_weights.
    """
    _check(x, w13, w2, topk_weights, topk_ids)
    num_experts, out = w13.shape[0], torch.zeros_like(x)
    local = topk_ids - expert_start
    for e in range(num_experts):
        token, slot = torch.where(local == e)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * topk_weights[token, slot, None]
        out = out.index_add(0, token, y.to(x.dtype))
    return out


def _check(x, w13, w2, topk_weights, topk_ids) -> None:
    e, two_i, h = w13.shape
    if x.dim() != 2 or x.shape[1] != h or tuple(w2.shape) != (e, h, two_i // 2) or two_i % 2:
        raise ValueError(f"fused_experts: expected x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got x {tuple(x.shape)}, "
                         f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_experts: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T={x.shape[0]}, K]")


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int, expert_start: int = 0
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the T*K slots by expert, each expert's run padded to a multiple of `block_size`.

    Returns (sorted_ids [P] int64: slot index t*K+k, or T*K for padding; expert_ids [P / block_size]
    int64: the local expert of each block, -1 for blocks past the end). P = T*K + E*(block_size-1)
    rounded up to block_size: an upper bound, so shapes depend only on T (no host sync). Slots routed
    to experts outside [expert_start, expert_start + num_experts) are dropped (expert parallelism).
    """
    flat = topk_ids.reshape(-1) - expert_start
    numel = flat.numel()
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    # scatter_add, not bincount: bincount reads the max on the host (a sync, no CUDA graph capture)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts = counts.scatter_add_(0, flat, torch.ones_like(flat))[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    padded_end = torch.cumsum(padded, 0)
    count_start, padded_start = torch.cumsum(counts, 0) - counts, padded_end - padded
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    valid = expert < num_experts
    safe = torch.where(valid, expert, 0)
    dest = padded_start[safe] + torch.arange(numel, device=flat.device) - count_start[safe]
    total = -(-(numel + num_experts * (block_size - 1)) // block_size) * block_size
    sorted_ids = torch.full((total + 1,), numel, dtype=torch.int64, device=flat.device)
    sorted_ids[torch.where(valid, dest, total)] = order  # invalid slots land in the spare last entry
    starts = torch.arange(0, total, block_size, device=flat.device)
    expert_ids = torch.searchsorted(padded_end, starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1)
    return sorted_ids[:total], expert_ids


@torch.compiler.disable  # data-dependent routing: torch.compile leaves it to the Triton path (a graph break)
def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_start: int = 0) -> torch.Tensor:
    """Same contract as `fused_experts_ref`; Triton grouped GEMMs when `use_triton(x)`, else the reference.

    Differentiable (an autograd Function) in x, w13, w2 and topk_weights on both paths.
    """
    _check(x, w13, w2, topk_weights, topk_ids)
    if not use_triton(x) or x.shape[0] == 0:
        return fused_experts_ref(x, w13, w2, topk_weights, topk_ids, expert_start)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w13, w2, topk_weights)):
        return _FusedExperts.apply(x, w13, w2, topk_weights, topk_ids, expert_start)
    return _forward(x, w13, w2, topk_weights, topk_ids, expert_start, save=False)[0]


def _block_m(num_slots: int, num_experts: int) -> int:
    return 16 if num_slots <= 4 * num_experts else 64  # few slots per expert: less padding


def _forward(x, w13, w2, topk_weights, topk_ids, expert_start: int, save: bool):
    """Triton forward: align, grouped GEMM (SiLU-and-mul epilogue), grouped GEMM, weighted sum over k."""
    t, k = topk_ids.shape
    num_experts = w13.shape[0]
    block_m = _block_m(t * k, num_experts)
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, block_m, num_experts, expert_start)
    act, h13 = grouped_gemm(x, w13, sorted_ids, expert_ids, t * k, a_div=k, block_m=block_m, silu_mul=True,
                            save_pre=save)
    y = grouped_gemm(act, w2, sorted_ids, expert_ids, t * k, a_div=1, block_m=block_m)[0]
    out = (y.float().view(t, k, -1) * topk_weights.float().view(t, k, 1)).sum(1).to(x.dtype)
    return out, ((sorted_ids, expert_ids, act, h13, y, k, block_m, expert_start) if save else None)


class _FusedExperts(torch.autograd.Function):
    """Triton forward; backward with the grouped GEMM for input grads, per-expert matmuls for weights."""

    @staticmethod
    def forward(ctx, x, w13, w2, topk_weights, topk_ids, expert_start):
        out, saved = _forward(x, w13, w2, topk_weights, topk_ids, expert_start, save=True)
        ctx.save_for_backward(x, w13, w2, topk_weights, *saved[:5])
        ctx.meta = saved[5:]
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, w13, w2, topk_weights, sorted_ids, expert_ids, act, h13, y = ctx.saved_tensors
        k, block_m, expert_start = ctx.meta
        t, num_slots = x.shape[0], x.shape[0] * k
        g = grad_out.float()
        grad_w = (y.float().view(t, k, -1) * g.view(t, 1, -1)).sum(-1).to(topk_weights.dtype)
        dy = (g.view(t, 1, -1) * topk_weights.float().view(t, k, 1)).reshape(num_slots, -1).to(x.dtype)
        w2_t = w2.transpose(1, 2)  # [E, I, H]: d act = dy @ w2[e]
        d_act = grouped_gemm(dy, w2_t, sorted_ids, expert_ids, num_slots, a_div=1, block_m=block_m)[0]
        gate, up = h13.float().chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        d_gate = d_act.float() * up * sig * (1 + gate * (1 - sig))
        d_h13 = torch.cat([d_gate, d_act.float() * F.silu(gate)], dim=-1).to(x.dtype)
        w13_t = w13.transpose(1, 2)  # [E, H, 2I]: dx slot = d_h13 @ w13[e]
        dx_slots = grouped_gemm(d_h13, w13_t, sorted_ids, expert_ids, num_slots, a_div=1, block_m=block_m)[0]
        dx = dx_slots.float().view(t, k, -1).sum(1).to(x.dtype)
        dw13, dw2 = _weight_grads(x, dy, act, d_h13, sorted_ids, expert_ids, k, block_m, w13.shape[0])
        return dx, dw13.to(w13.dtype), dw2.to(w2.dtype), grad_w, None, None


def _weight_grads(x, dy, act, d_h13, sorted_ids, expert_ids, k, block_m, num_experts):
    """dW13[e] = d_h13[slots of e]^T x[tokens of e]; dW2[e] = dy[slots]^T act[slots] (float32 accumulate).

    One matmul pair per expert over its run of sorted slots (one host sync for the run lengths).
    """
    num_slots = dy.shape[0]
    dw13 = torch.zeros((num_experts, d_h13.shape[1], x.shape[1]), dtype=torch.float32, device=x.device)
    dw2 = torch.zeros((num_experts, dy.shape[1], act.shape[1]), dtype=torch.float32, device=x.device)
    block_expert = expert_ids.repeat_interleave(block_m)[: sorted_ids.numel()]
    valid = (sorted_ids < num_slots) & (block_expert >= 0)
    slots, experts = sorted_ids[valid], block_expert[valid]
    counts = torch.bincount(experts, minlength=num_experts).tolist()
    for e, part in enumerate(slots.split(counts)):
        if part.numel():
            dw13[e] = d_h13[part].float().t() @ x[part // k].float()
            dw2[e] = dy[part].float().t() @ act[part].float()
    return dw13, dw2
