"""The MoE block's RMSNorm (with its residual add) folded into the router launch, for a few tokens.

A decoder layer runs ``x, residual = post_attention_layernorm(hidden, residual)`` and then routes x.
At batch-1 decode the norm is its own launch of ~1.8 us per layer on an H200 (48 x ``rms_norm_kernel``,
88 us per step: benchmarks/results/2026-12-01-qwen3-30b-a3b-native-b1-decode-profile.json), for 8 KB
of data. `norm_route_experts` does it inside the router (`fxrewrite.kernels.moe_router`): every router
program of a token recomputes the token's 1/rms (its row of hidden + residual is a few KB, read from
L2 by all but the first program), applies the norm to the chunks it multiplies with its gate rows
(when the row and the program's gate rows fit in registers, all loaded at once, so the norm adds no
second memory round trip before the gate reads),
and the token's first expert block stores the normed row and the new residual for the experts
kernels that follow in the stream. Results equal ``rms_norm`` then ``route_experts`` (the same
roundings: the add and the normed row in the input dtype, the statistics in float32).
Specification: `norm_route_experts_ref`.
"""

from __future__ import annotations

import torch

from fxrewrite.kernels.moe_router import (GEMM, choice_for, counters, fused_router_applies, route_experts,
                                          route_experts_ref, store_logits_and_select)
from fxrewrite.kernels.moe_routing import check_routing
from fxrewrite.kernels.pdl import early_loads, gdc_prologue, pdl_enabled
from fxrewrite.kernels.rms_norm import rms_norm, rms_norm_ref
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["norm_route_experts", "norm_route_experts_ref"]


def norm_route_experts_ref(hidden: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           weight: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str = "softmax"):
    """hidden, residual [T, H]; RMSNorm weight [H]; router weight [E, H] -> (topk_weights [T, K] float32,
    topk_ids [T, K] int64, normed x [T, H], new residual [T, H]): ``rms_norm_ref`` with the residual add,
    then `route_experts_ref` of the normed x."""
    x, new_residual = rms_norm_ref(hidden, norm_weight, eps, residual)
    return (*route_experts_ref(x, weight, top_k, renormalize, scoring_func), x, new_residual)


@triton.jit
def _norm_router_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, normed_ptr, res_out_ptr, logits_ptr, counter_ptr, weights_ptr,
                        ids_ptr, num_experts, eps, stride_we, HIDDEN: tl.constexpr, TOP_K: tl.constexpr,
                        RENORMALIZE: tl.constexpr, SOFTMAX: tl.constexpr, BLOCK_SPLIT: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RANKED: tl.constexpr,
                        ONE_SHOT: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    if not (ONE_SHOT and EARLY):
        gdc_prologue(PDL)  # hidden and residual come from the previous kernel: wait before any read or write
    row = tl.program_id(0).to(tl.int64)
    writer = tl.program_id(1) == 0  # the token's first expert block stores the normed row and the residual
    offs_e = tl.program_id(1) * BLOCK_SPLIT + tl.arange(0, BLOCK_SPLIT)
    e_mask = offs_e < num_experts
    if ONE_SHOT:  # the whole row and the gate rows loaded at once: one memory latency, not two in a row
        offs_h = tl.arange(0, BLOCK_H)
        h_mask = offs_h < HIDDEN
        # the weights (EARLY: while the previous kernel finishes, kernels/pdl.py early_loads)
        w = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * stride_we + offs_h[None, :],
                    mask=e_mask[:, None] & h_mask[None, :], other=0.0)
        nw = tl.load(nw_ptr + offs_h, mask=h_mask, other=0.0)
        if EARLY:
            gdc_prologue(PDL)
        s = tl.load(x_ptr + row * HIDDEN + offs_h, mask=h_mask, other=0.0)
        s = s + tl.load(res_ptr + row * HIDDEN + offs_h, mask=h_mask, other=0.0)  # rounded in the input dtype
        rstd = tl.rsqrt(tl.sum(s.to(tl.float32) * s.to(tl.float32), axis=0) / HIDDEN + eps)
        xn = ((s.to(tl.float32) * rstd).to(s.dtype).to(tl.float32) * nw.to(tl.float32)).to(s.dtype)
        if writer:
            tl.store(res_out_ptr + row * HIDDEN + offs_h, s, mask=h_mask)
            tl.store(normed_ptr + row * HIDDEN + offs_h, xn, mask=h_mask)
        acc = w.to(tl.float32) * xn.to(tl.float32)[None, :]
    else:
        sq = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for h0 in tl.static_range(0, HIDDEN, BLOCK_H):  # the statistics: sum of squares of hidden + residual
            offs_h = h0 + tl.arange(0, BLOCK_H)
            h_mask = offs_h < HIDDEN
            s = tl.load(x_ptr + row * HIDDEN + offs_h, mask=h_mask, other=0.0)
            s = s + tl.load(res_ptr + row * HIDDEN + offs_h, mask=h_mask, other=0.0)
            if writer:
                tl.store(res_out_ptr + row * HIDDEN + offs_h, s, mask=h_mask)
            sq += s.to(tl.float32) * s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(sq, axis=0) / HIDDEN + eps)
        acc = tl.zeros((BLOCK_SPLIT, BLOCK_H), dtype=tl.float32)
        for h0 in tl.static_range(0, HIDDEN, BLOCK_H):  # the GEMV of the normed chunks (rms_norm's roundings)
            offs_h = h0 + tl.arange(0, BLOCK_H)
            h_mask = offs_h < HIDDEN
            s = tl.load(x_ptr + row * HIDDEN + offs_h, mask=h_mask, other=0.0)
            s = s + tl.load(res_ptr + row * HIDDEN + offs_h, mask=h_mask, other=0.0)
            nw = tl.load(nw_ptr + offs_h, mask=h_mask, other=0.0)
            xn = ((s.to(tl.float32) * rstd).to(s.dtype).to(tl.float32) * nw.to(tl.float32)).to(s.dtype)
            if writer:
                tl.store(normed_ptr + row * HIDDEN + offs_h, xn, mask=h_mask)
            w = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * stride_we + offs_h[None, :],
                        mask=e_mask[:, None] & h_mask[None, :], other=0.0)
            acc += w.to(tl.float32) * xn.to(tl.float32)[None, :]
    store_logits_and_select(acc, offs_e, e_mask, row, logits_ptr, counter_ptr, weights_ptr, ids_ptr, num_experts,
                            TOP_K, RENORMALIZE, SOFTMAX, BLOCK_E, BLOCK_K, RANKED)


def _applies(hidden, residual, norm_weight, weight, cfg) -> bool:
    return (cfg != GEMM and fused_router_applies(hidden, weight, None) and residual.shape == hidden.shape
            and residual.dtype == hidden.dtype == norm_weight.dtype and hidden.is_contiguous()
            and residual.is_contiguous() and norm_weight.shape == (hidden.shape[1],) and norm_weight.is_contiguous()
            and not (torch.is_grad_enabled() and (residual.requires_grad or norm_weight.requires_grad)))


def norm_route_experts(hidden: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str = "softmax",
                       config=None, weights_dtype: torch.dtype = torch.float32):
    """Same contract as `norm_route_experts_ref`. One launch when the router's fused form applies (Triton,
    1..FUSED_ROUTER_MAX_TOKENS tokens, contiguous rows, one dtype, no autograd) and the shape's router
    choice (`config`, else `choice_for`) is not the GEMM pair; else ``rms_norm`` then `route_experts`.
    `weights_dtype`: as `route_experts`'."""
    cfg = config or choice_for(weight.shape[0], weight.shape[-1], top_k)
    if not _applies(hidden, residual, norm_weight, weight, cfg):
        x, new_residual = rms_norm(hidden, norm_weight, eps, residual)
        return (*route_experts(x, weight, top_k, renormalize, scoring_func, config=cfg, weights_dtype=weights_dtype),
                x, new_residual)
    t, h = hidden.shape
    num_experts = weight.shape[0]
    check_routing(hidden.new_empty(0, num_experts), top_k, scoring_func)
    if weight.shape[1] != h:
        raise ValueError(f"router weight {tuple(weight.shape)} does not match hidden states {tuple(hidden.shape)}")
    x, new_residual = torch.empty_like(hidden), torch.empty_like(hidden)
    logits = torch.empty(t, num_experts, dtype=hidden.dtype, device=hidden.device)
    weights = torch.empty(t, top_k, dtype=weights_dtype, device=hidden.device)  # the kernel's store rounds to it
    ids = torch.empty(t, top_k, dtype=torch.int64, device=hidden.device)
    split = min(cfg.experts_per_program, next_power_of_2(num_experts))
    # one shot when the row and the gate rows fit in registers: <= 64 gate values per thread
    one_shot = split * next_power_of_2(h) <= 64 * 32 * cfg.num_warps
    block_h = next_power_of_2(h) if one_shot else min(cfg.block_h, next_power_of_2(h))
    pdl = pdl_enabled(hidden.device)
    launch(_norm_router_kernel, (t, triton.cdiv(num_experts, split)), hidden.device, pdl)(
        hidden, residual, norm_weight, weight, x, new_residual, logits, counters(hidden.device), weights, ids,
        num_experts, float(eps), weight.stride(0), HIDDEN=h, TOP_K=top_k, RENORMALIZE=renormalize,
        SOFTMAX=scoring_func == "softmax", BLOCK_SPLIT=split, BLOCK_H=block_h,
        BLOCK_E=next_power_of_2(num_experts), BLOCK_K=next_power_of_2(top_k),
        RANKED=cfg.ranked and num_experts <= 128, ONE_SHOT=one_shot, PDL=pdl, EARLY=early_loads(pdl, True),
        num_warps=cfg.num_warps)
    return weights, ids, x, new_residual
