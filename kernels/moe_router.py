"""MoE router: the gate GEMV, the scores and the top-k of a few tokens in one launch.

At decode the router is a [T, H] x [E, H]^T product (Qwen3-30B-A3B: 0.5 MB of weights) followed by
the top-k selection. As a cuBLAS GEMV plus `select_experts` it costs two launches per layer, ~8 us
on an H200 (benchmarks/results/2026-12-01-qwen3-30b-a3b-native-b1-decode-profile.json), nearly all
of it latency. `route_experts` does both in one launch for T <= `FUSED_ROUTER_MAX_TOKENS`:

* grid (token, expert block): each program computes its block of logits (float32 accumulation,
  rounded to the hidden states' dtype, as ``F.linear`` returns them: transformers' routers take
  ``softmax(router_logits, dtype=float32)`` of those) and stores them to a scratch row;
* the program that finishes a token last (a per-token arrival counter, the classic "last block"
  reduction: barrier, then a gpu-scope acq_rel atomic) reads the whole row back and runs the same
  top-k as `select_experts` (`select_top_k`), then resets the counter to zero for the next launch.

Rows per program, warps and the top-k form are a `RouterConfig`, chosen per router shape when a model
is loaded on a GPU (`fxrewrite.kernels.moe_router_tune`: each candidate and the GEMM + top-k pair timed
in CUDA graphs, checked against the reference first).

The result does not depend on which program arrives last (the logits are each computed by one
program, the top-k reads them all): deterministic. The counters live in a per-device buffer that
stays zero between launches, so the launch is CUDA-graph safe; launches on one stream only (the
engine's case). Specification: `route_experts_ref` (transformers' ``Qwen3MoeTopKRouter``,
``OlmoeTopKRouter``, ``MixtralTopKRouter``: linear -> float32 softmax -> top-k -> optional renorm).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fxrewrite.kernels import use_triton
from fxrewrite.kernels.batch_invariant import is_batch_invariant
from fxrewrite.kernels.moe_routing import check_routing, select_experts, select_experts_ref, select_top_k
from fxrewrite.kernels.pdl import gdc_prologue, pdl_enabled
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["FUSED_ROUTER_MAX_TOKENS", "GEMM", "ROUTER_CONFIGS", "RouterConfig", "choice_for", "counters", "record",
           "route_experts", "route_experts_ref", "store_logits_and_select"]

FUSED_ROUTER_MAX_TOKENS = 8
"""Largest token count routed by the fused kernel; above it the GEMM + `select_experts` pair runs."""


class RouterConfig(NamedTuple):
    """One launch shape of `_router_kernel`: gate rows (experts) per program, hidden chunk per unrolled
    step, warps per program, and whether the last program ranks all scores at once (needs 4+ warps)."""
    experts_per_program: int
    block_h: int
    num_warps: int
    ranked: bool


ROUTER_CONFIGS = (RouterConfig(1, 256, 1, False), RouterConfig(2, 256, 1, False), RouterConfig(1, 512, 2, False),
                  RouterConfig(2, 512, 4, False), RouterConfig(4, 256, 4, False), RouterConfig(4, 256, 4, True))
"""Candidates the load-time tuner (`fxrewrite.kernels.moe_router_tune`) times; the first is the default.
The default: one gate row and one warp per program (Qwen3-30B-A3B: 128 programs per token, one per SM,
each with its whole 4 KB row in flight), so the last program's top-k is TOP_K rounds of warp-shuffle
argmax. The 2026-12-01 profile's form, 4 rows and 4 warps per program with the E x E rank compare
(last entry), took 11.3 us per call, slower than the cuBLAS GEMV + top-k pair it replaced (~8 us)."""
GEMM = "gemm"
"""The tuner's other candidate: ``select_experts(F.linear(x, w))`` (two launches)."""
_CHOICES: dict[tuple[int, int, int], RouterConfig | str] = {}
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def record(num_experts: int, hidden: int, top_k: int, choice: RouterConfig | str | None) -> None:
    """Make `choice` (a RouterConfig, GEMM, or None: the default) what `route_experts` runs for this shape."""
    if choice is None:
        _CHOICES.pop((num_experts, hidden, top_k), None)
    else:
        _CHOICES[(num_experts, hidden, top_k)] = choice


def choice_for(num_experts: int, hidden: int, top_k: int) -> RouterConfig | str:
    """The recorded choice for the shape, else FXREWRITE_ROUTER_CONFIG ("gemm" or "rows/block_h/warps/ranked",
    e.g. "1/256/1/0"), else ROUTER_CONFIGS[0]."""
    if (num_experts, hidden, top_k) in _CHOICES:
        return _CHOICES[(num_experts, hidden, top_k)]
    forced = os.environ.get("FXREWRITE_ROUTER_CONFIG", "")
    if forced == GEMM:
        return GEMM
    if forced:
        try:
            rows, block_h, warps, ranked = (int(v) for v in forced.split("/"))
        except ValueError:
            raise ValueError(f"FXREWRITE_ROUTER_CONFIG={forced!r}: expected 'gemm' or 'rows/block_h/warps/ranked' "
                             f"(four integers, e.g. '1/256/1/0')") from None
        return RouterConfig(rows, block_h, warps, bool(ranked))
    return ROUTER_CONFIGS[0]


def route_experts_ref(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                      scoring_func: str = "softmax", bias: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], router weight [E, H] (optional bias [E]) -> (topk_weights [T, K] float32,
    topk_ids [T, K] int64): ``select_experts_ref(F.linear(x, weight, bias), ...)``; errors as there."""
    return select_experts_ref(F.linear(x, weight, bias), top_k, renormalize, scoring_func)


@triton.jit
def _router_kernel(x_ptr, w_ptr, logits_ptr, counter_ptr, weights_ptr, ids_ptr, num_experts, stride_xt, stride_we,
                   HIDDEN: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, SOFTMAX: tl.constexpr,
                   BLOCK_SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                   RANKED: tl.constexpr, PDL: tl.constexpr):
    gdc_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_e = tl.program_id(1) * BLOCK_SPLIT + tl.arange(0, BLOCK_SPLIT)
    e_mask = offs_e < num_experts
    acc = tl.zeros((BLOCK_SPLIT, BLOCK_H), dtype=tl.float32)
    for h0 in tl.static_range(0, HIDDEN, BLOCK_H):  # unrolled: all of the block's gate rows in flight
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_mask = offs_h < HIDDEN
        xv = tl.load(x_ptr + row * stride_xt + offs_h, mask=h_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * stride_we + offs_h[None, :],
                    mask=e_mask[:, None] & h_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * xv[None, :]
    store_logits_and_select(acc, offs_e, e_mask, row, logits_ptr, counter_ptr, weights_ptr, ids_ptr, num_experts,
                            TOP_K, RENORMALIZE, SOFTMAX, BLOCK_E, BLOCK_K, RANKED)


@triton.jit
def store_logits_and_select(acc, offs_e, e_mask, row, logits_ptr, counter_ptr, weights_ptr, ids_ptr, num_experts,
                            TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, SOFTMAX: tl.constexpr,
                            BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RANKED: tl.constexpr):
    """A router program's end: its logits (`acc` [rows, chunk] summed over the chunk) to the scratch row;
    the token's last-arriving program selects its top-k over the whole row."""
    logits = tl.sum(acc, axis=1).to(logits_ptr.dtype.element_ty)  # F.linear's output dtype
    tl.store(logits_ptr + row * num_experts + offs_e, logits, mask=e_mask)
    tl.debug_barrier()  # every thread's logits stored before the arrival is released
    arrived = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(1) - 1:  # the token's last program: all its logits are stored
        tl.atomic_xchg(counter_ptr + row, 0, sem="relaxed", scope="gpu")
        offs = tl.arange(0, BLOCK_E)
        valid = offs < num_experts
        x = tl.load(logits_ptr + row * num_experts + offs, mask=valid, other=0.0, volatile=True).to(tl.float32)
        select_top_k(x, valid, offs, weights_ptr, ids_ptr, row, TOP_K, RENORMALIZE, SOFTMAX, BLOCK_E, BLOCK_K,
                     RANKED)


def counters(device: torch.device) -> torch.Tensor:
    """The per-device arrival counters (zero between launches: each launch's last programs reset theirs)."""
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(FUSED_ROUTER_MAX_TOKENS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def fused_router_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `route_experts` takes the one-launch kernel: Triton available for x, 1..8 tokens, no
    bias, x and weight of one dtype with unit last strides, no autograd (the kernel has no backward)."""
    if not use_triton(x) or x.dim() != 2 or not 1 <= x.shape[0] <= FUSED_ROUTER_MAX_TOKENS or bias is not None:
        return False
    if weight.dim() != 2 or x.dtype != weight.dtype or x.stride(-1) != 1 or weight.stride(-1) != 1:
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


def route_experts(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                  scoring_func: str = "softmax", bias: torch.Tensor | None = None,
                  config: RouterConfig | str | None = None,
                  weights_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `route_experts_ref`; one Triton launch when `fused_router_applies` and the shape's
    choice (`config`, else `choice_for`) is a RouterConfig, else ``select_experts(F.linear(x, weight, bias),
    ...)`` (the Triton top-k where it applies); in `batch_invariant_mode`, the latter (the batch-invariant F.linear,
    the reference top-k), as a trainer's recomputation runs it. `weights_dtype`: the one launch stores the
    weights rounded to it (a router that casts them, as Qwen3-MoE's does, without a cast kernel after); the other
    paths return float32."""
    cfg = config or choice_for(weight.shape[0], weight.shape[-1], top_k)
    if cfg == GEMM or not fused_router_applies(x, weight, bias) or is_batch_invariant():
        return select_experts(F.linear(x, weight, bias), top_k, renormalize, scoring_func)
    t, hidden = x.shape
    num_experts = weight.shape[0]
    check_routing(x.new_empty(0, num_experts), top_k, scoring_func)
    if weight.shape[1] != hidden:
        raise ValueError(f"router weight {tuple(weight.shape)} does not match hidden states {tuple(x.shape)}")
    logits = torch.empty(t, num_experts, dtype=x.dtype, device=x.device)
    weights = torch.empty(t, top_k, dtype=weights_dtype, device=x.device)  # the kernel's store rounds to it
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    split = min(cfg.experts_per_program, next_power_of_2(num_experts))
    pdl = pdl_enabled(x.device)
    launch(_router_kernel, (t, triton.cdiv(num_experts, split)), x.device, pdl)(
        x, weight, logits, counters(x.device), weights, ids, num_experts, x.stride(0), weight.stride(0),
        HIDDEN=hidden, TOP_K=top_k, RENORMALIZE=renormalize, SOFTMAX=scoring_func == "softmax",
        BLOCK_SPLIT=split, BLOCK_H=min(cfg.block_h, next_power_of_2(hidden)), BLOCK_E=next_power_of_2(num_experts),
        BLOCK_K=next_power_of_2(top_k), RANKED=cfg.ranked and num_experts <= 128, PDL=pdl, num_warps=cfg.num_warps)
    return weights, ids
