"""MoE routing: top-k expert selection and the alignment of (token, expert) slots by expert.

Both run once per MoE layer and step, on tiny tensors, so their cost is kernel launches: the torch
references take about twenty small kernels (softmax, top-k, a sort, scans, scatters); the Triton
versions take one (`select_experts`) and four (`moe_align_block_size`: a fill, per-chunk counts, one
scan, a scatter). Measured on an H200 (Qwen3-30B-A3B, batch-1 decode, 2026-11-30): the references'
small kernels were ~3 ms of a 9 ms step. The references are the specification; the Triton versions
give the same results (ids and weights exactly for distinct scores; the same slot sets per expert,
in slot order, as the stable sort of the reference).

Design facts from vLLM's ``topk_softmax`` and ``moe_align_block_size`` CUDA kernels (one program per
token for the top-k; counts, a prefix sum padded per expert, then a scatter); the code is our own.
"""

from __future__ import annotations

import torch

from fxrewrite.kernels import use_triton
from fxrewrite.kernels.batch_invariant import is_batch_invariant
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["SCORING", "check_routing", "select_top_k", "select_experts", "select_experts_ref", "moe_align_block_size",
           "moe_align_block_size_ref"]

SCORING = ("softmax", "sigmoid")
ALIGN_CHUNK = 128
"""Slots per program in the count and scatter kernels (the in-chunk rank is a CHUNK x CHUNK compare)."""


def check_routing(router_logits: torch.Tensor, top_k: int, scoring_func: str) -> None:
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts})")
    if scoring_func not in SCORING:
        raise ValueError(f"scoring_func={scoring_func!r}, expected one of {SCORING}")


def select_experts_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str = "softmax",
                       out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, top_k] float32 or `out_dtype`, topk_ids [T, top_k] int64).

    Scores are softmax (or sigmoid) over experts in float32, the top_k largest are kept (largest
    first), and with `renormalize` divided by their sum (transformers' ``norm_topk_prob``).
    ValueError when top_k is not in [1, E] or scoring_func is unknown.
    """
    check_routing(router_logits, top_k, scoring_func)
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if scoring_func == "softmax" else logits.sigmoid()
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if out_dtype is None else weights.to(out_dtype)), ids


@triton.jit
def select_top_k(x, valid, offs, weights_ptr, ids_ptr, row, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                 SOFTMAX: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RANKED: tl.constexpr):
    """Scores of one token's float32 logits `x` [BLOCK_E] (lanes with `valid` False ignored), its
    top-k stored at row `row` of weights [T, K] float32 and ids [T, K] int64 (`select_experts_ref`).
    RANKED (BLOCK_E <= 128 only): one E x E rank compare instead of TOP_K rounds of argmax; the
    rounds are cheaper when the program is one warp (every reduction stays in warp shuffles)."""
    if SOFTMAX:
        x = tl.where(valid, x, float("-inf"))
        e = tl.exp(x - tl.max(x, axis=0))
        scores = e / tl.sum(e, axis=0)
    else:
        scores = tl.sigmoid(x)
    scores = tl.where(valid, scores, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    if RANKED:  # up to 128 experts the E x E compare below fits in registers (4+ warps)
        # each expert's rank among the scores (ties: the lower index first), in one pass: a few parallel
        # reductions instead of 2 * top_k dependent cross-warp ones (the latency of this kernel)
        s_i, s_j = scores[:, None], scores[None, :]
        beats = (s_j > s_i) | ((s_j == s_i) & (offs[None, :] < offs[:, None]))
        rank = tl.sum(beats.to(tl.int32), axis=1)
        hit = (rank[None, :] == slots[:, None]) & (slots < TOP_K)[:, None]  # one expert per kept slot
        top_i = tl.sum(tl.where(hit, offs[None, :], 0), axis=1)
        top_w = tl.sum(tl.where(hit, scores[None, :], 0.0), axis=1)
    else:
        top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
        top_i = tl.zeros((BLOCK_K,), dtype=tl.int32)
        for k in tl.static_range(TOP_K):  # k rounds of argmax (the first index among equal scores)
            best = tl.max(scores, axis=0)
            idx = tl.min(tl.where(scores == best, offs, BLOCK_E), axis=0)
            top_w = tl.where(slots == k, best, top_w)
            top_i = tl.where(slots == k, idx, top_i)
            scores = tl.where(offs == idx, float("-inf"), scores)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    out = slots < TOP_K
    tl.store(weights_ptr + row * TOP_K + slots, top_w, mask=out)
    tl.store(ids_ptr + row * TOP_K + slots, top_i.to(tl.int64), mask=out)


@triton.jit
def _select_experts_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_t,
                           TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, SOFTMAX: tl.constexpr,
                           BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    x = tl.load(logits_ptr + row * stride_t + offs, mask=valid, other=0.0).to(tl.float32)
    select_top_k(x, valid, offs, weights_ptr, ids_ptr, row, TOP_K, RENORMALIZE, SOFTMAX, BLOCK_E, BLOCK_K,
                 BLOCK_E <= 128)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str = "softmax",
                   out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `select_experts_ref`; one Triton program per token when `use_triton` and the
    logits need no gradient, outside `batch_invariant_mode` (where a trainer's recomputation, with gradients,
    runs the reference, and the engine must round as it does)."""
    check_routing(router_logits, top_k, scoring_func)
    # the kernel has no backward: with autograd on the logits the reference runs (router gradients)
    if (not use_triton(router_logits) or router_logits.dim() != 2 or router_logits.shape[0] == 0
            or (torch.is_grad_enabled() and router_logits.requires_grad) or is_batch_invariant()):
        return select_experts_ref(router_logits, top_k, renormalize, scoring_func, out_dtype)
    t, e = router_logits.shape
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    launch(_select_experts_kernel, (t,), logits.device)(
        logits, weights, ids, e, logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize,
        SOFTMAX=scoring_func == "softmax", BLOCK_E=next_power_of_2(e),
        BLOCK_K=next_power_of_2(top_k))
    return (weights if out_dtype is None else weights.to(out_dtype)), ids


def align_total(num_slots: int, block_size: int, num_experts: int) -> int:
    """P, the length of `moe_align_block_size`'s sorted_ids: T*K + E*(block_size-1) rounded up to
    block_size (an upper bound, so shapes depend only on T: no host sync, CUDA-graph safe)."""
    return -(-(num_slots + num_experts * (block_size - 1)) // block_size) * block_size


def moe_align_block_size_ref(topk_ids: torch.Tensor, block_size: int, num_experts: int, expert_start: int = 0
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the T*K slots by expert, each expert's run padded to a multiple of `block_size`.

    Returns (sorted_ids [P] int64: slot index t*K+k in slot order within an expert, or T*K for
    padding; expert_ids [P / block_size] int64: the local expert of each block, -1 for blocks past the
    end), P = `align_total`. Slots routed to experts outside [expert_start, expert_start + num_experts)
    are dropped (expert parallelism).
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
    total = align_total(numel, block_size, num_experts)
    sorted_ids = torch.full((total + 1,), numel, dtype=torch.int64, device=flat.device)
    sorted_ids[torch.where(valid, dest, total)] = order  # invalid slots land in the spare last entry
    starts = torch.arange(0, total, block_size, device=flat.device)
    expert_ids = torch.searchsorted(padded_end, starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1)
    return sorted_ids[:total], expert_ids


@triton.jit
def _local_expert(ids_ptr, chunk, numel, expert_start, num_experts, CHUNK: tl.constexpr):
    """The chunk's slots, their local expert (num_experts when remote or past the end) and validity."""
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    in_range = offs < numel
    e = tl.load(ids_ptr + offs, mask=in_range, other=0).to(tl.int32) - expert_start
    valid = in_range & (e >= 0) & (e < num_experts)
    return offs, tl.where(valid, e, num_experts), valid


@triton.jit(do_not_specialize=["numel"])  # token counts: no new specialisation per step
def _align_count_kernel(ids_ptr, counts_ptr, numel, expert_start, num_experts,
                        CHUNK: tl.constexpr, NUM_BINS: tl.constexpr):
    chunk = tl.program_id(0)
    _, e, _ = _local_expert(ids_ptr, chunk, numel, expert_start, num_experts, CHUNK)
    hist = tl.histogram(e, NUM_BINS)  # bin num_experts collects remote slots and is not stored
    bins = tl.arange(0, NUM_BINS)
    tl.store(counts_ptr + chunk * num_experts + bins, hist, mask=bins < num_experts)


@triton.jit(do_not_specialize=["num_chunks", "num_blocks"])
def _align_scan_kernel(counts_ptr, offsets_ptr, start_ptr, expert_ids_ptr, num_chunks, num_experts, num_blocks,
                       block_size, BLOCK_E: tl.constexpr, CHUNK_TILE: tl.constexpr, BLOCK_TILE: tl.constexpr):
    experts = tl.arange(0, BLOCK_E)
    e_mask = experts < num_experts
    running = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, num_chunks, CHUNK_TILE):  # each chunk's first position within its expert's run
        rows = c0 + tl.arange(0, CHUNK_TILE)
        mask = (rows[:, None] < num_chunks) & e_mask[None, :]
        ptrs = rows[:, None] * num_experts + experts[None, :]
        c = tl.load(counts_ptr + ptrs, mask=mask, other=0)
        tl.store(offsets_ptr + ptrs, tl.cumsum(c, axis=0) - c + running[None, :], mask=mask)
        running += tl.sum(c, axis=0)
    padded = (running + block_size - 1) // block_size * block_size
    padded_end = tl.cumsum(padded, axis=0)
    tl.store(start_ptr + experts, padded_end - padded, mask=e_mask)
    end = tl.where(e_mask, padded_end, 2147483647)
    for b0 in range(0, num_blocks, BLOCK_TILE):  # block b belongs to the expert whose run covers b*block_size
        blocks = b0 + tl.arange(0, BLOCK_TILE)
        expert = tl.sum((end[None, :] <= blocks[:, None] * block_size).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blocks, tl.where(expert < num_experts, expert, -1).to(tl.int64),
                 mask=blocks < num_blocks)


@triton.jit(do_not_specialize=["numel"])
def _align_scatter_kernel(ids_ptr, offsets_ptr, start_ptr, sorted_ptr, numel, expert_start, num_experts,
                          CHUNK: tl.constexpr):
    chunk = tl.program_id(0)
    offs, e, valid = _local_expert(ids_ptr, chunk, numel, expert_start, num_experts, CHUNK)
    lane = tl.arange(0, CHUNK)
    earlier = (e[:, None] == e[None, :]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)  # slots of the same expert before this one in the chunk
    safe = tl.where(valid, e, 0)
    base = tl.load(start_ptr + safe, mask=valid, other=0) + tl.load(offsets_ptr + chunk * num_experts + safe,
                                                                    mask=valid, other=0)
    tl.store(sorted_ptr + base + rank, offs.to(tl.int64), mask=valid)


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int, expert_start: int = 0
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract and results as `moe_align_block_size_ref`; four launches when `use_triton`."""
    if not use_triton(topk_ids) or topk_ids.numel() == 0:
        return moe_align_block_size_ref(topk_ids, block_size, num_experts, expert_start)
    flat = topk_ids.reshape(-1)
    numel, device = flat.numel(), flat.device
    total = align_total(numel, block_size, num_experts)
    num_chunks, num_blocks = triton.cdiv(numel, ALIGN_CHUNK), total // block_size
    counts = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=device)
    offsets = torch.empty_like(counts)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_ids = torch.full((total,), numel, dtype=torch.int64, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int64, device=device)
    launch(_align_count_kernel, (num_chunks,), device)(
        flat, counts, numel, expert_start, num_experts, CHUNK=ALIGN_CHUNK, NUM_BINS=next_power_of_2(num_experts + 1))
    launch(_align_scan_kernel, (1,), device)(
        counts, offsets, starts, expert_ids, num_chunks, num_experts, num_blocks, block_size,
        BLOCK_E=next_power_of_2(num_experts), CHUNK_TILE=16, BLOCK_TILE=64)
    launch(_align_scatter_kernel, (num_chunks,), device)(
        flat, offsets, starts, sorted_ids, numel, expert_start, num_experts, CHUNK=ALIGN_CHUNK)
    return sorted_ids, expert_ids
