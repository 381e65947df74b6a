"""Few-token MoE experts: GEMV kernels indexed directly by the top-k ids (no sort, no alignment).

For decode at small batch the grouped GEMM path (`fxrewrite.kernels.fused_moe`) spends most of its
time outside the weight reads: the slot alignment (a fill and three launches), padded row blocks
of which one row in sixteen is real, a float32 output fill and the weighted sum over k. Here two
launches do the whole experts computation of ``fused_experts_ref`` for T tokens and K slots each:

1. ``_direct_gate_up_kernel``, one program per (slot, N-tile): reads x[t] and the tile's rows of
   gate and up of expert ``ids[slot]`` only, and stores ``silu(gate) * up`` (float32 accumulation,
   stored in x's dtype as the grouped path does);
2. ``_direct_down_kernel``, one program per (token, H-tile): reads the tile's rows of w2 of all the
   token's K experts as one [K, rows, chunk] tile per step and accumulates ``w[t, k] * (w2_e @ act[slot])``
   in float32, so the combine over k is fused (a fixed-order in-program sum: no atomics, deterministic).
   The earlier form looped over the K slots with 8-row tiles and read at ~1.1 TB/s on an H200
   (benchmarks/results/2026-12-01-qwen3-30b-a3b-native-b1-decode-profile.json): too few bytes in flight.

Only the active experts' weights are read: the bytes of a decode step's experts are K rows of
experts per token, which is the roofline the latency benchmark measures against. Slots routed to
experts outside ``[expert_start, expert_start + E_local)`` (expert parallelism) read nothing and
contribute zero. The specification is `fxrewrite.kernels.fused_moe.fused_experts_ref`. Design fact
from vLLM/SGLang's small-batch MoE paths (skip the alignment when T*K is small, index experts by
the top-k ids); the code is our own.
"""

from __future__ import annotations

import torch

from fxrewrite.kernels.pdl import gdc_prologue, pdl_enabled
from fxrewrite.kernels.triton_utils import launch, tl, triton

__all__ = ["DIRECT_MAX_TOKENS", "direct_config", "direct_down", "direct_experts", "direct_gate_up"]

DIRECT_MAX_TOKENS = 8
"""Largest token count sent to the direct path by `fused_experts` at inference. Above it, tokens
share experts often enough that the grouped GEMM (each expert's weights read once) wins."""


@triton.jit
def _direct_gate_up_kernel(x_ptr, w13_ptr, ids_ptr, act_ptr, expert_start, num_local, stride_xt,
                           stride_we, stride_wn, stride_wk, inter,
                           TOP_K: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PDL: tl.constexpr):
    gdc_prologue(PDL)
    slot = tl.program_id(0)
    expert = tl.load(ids_ptr + slot).to(tl.int32) - expert_start
    if (expert < 0) | (expert >= num_local):  # another rank's expert: its act row is never read
        return
    token = (slot // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    base = w13_ptr + expert.to(tl.int64) * stride_we
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.static_range(0, HIDDEN, BLOCK_K):  # unrolled: the loads can all be issued early
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < HIDDEN
        xv = tl.load(x_ptr + token * stride_xt + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        mask = n_mask[:, None] & k_mask[None, :]
        ptrs = base + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
        gate = tl.load(ptrs, mask=mask, other=0.0)
        up = tl.load(ptrs + inter * stride_wn, mask=mask, other=0.0)
        acc_gate += gate.to(tl.float32) * xv[None, :]
        acc_up += up.to(tl.float32) * xv[None, :]
    g = tl.sum(acc_gate, axis=1)
    act = g * tl.sigmoid(g) * tl.sum(acc_up, axis=1)
    tl.store(act_ptr + slot.to(tl.int64) * inter + offs_n, act.to(act_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _direct_down_kernel(act_ptr, w2_ptr, ids_ptr, weights_ptr, res_ptr, out_ptr, expert_start, num_local, hidden,
                        stride_we, stride_wn, stride_wk, TOP_K: tl.constexpr, INTER: tl.constexpr,
                        BLOCK_TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    gdc_prologue(PDL)
    # One [top-k slots, BLOCK_N rows, BLOCK_K] tile per step: the token's K experts' rows are read
    # together (K times more bytes in flight per load than a loop over slots), and the sum over
    # the slots is a fixed-order reduction inside the program (deterministic, no atomics).
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    slot = token * TOP_K + tl.arange(0, BLOCK_TOPK)
    in_topk = tl.arange(0, BLOCK_TOPK) < TOP_K
    expert = tl.load(ids_ptr + slot, mask=in_topk, other=-1).to(tl.int32) - expert_start
    local = in_topk & (expert >= 0) & (expert < num_local)  # a remote slot loads nothing and adds zero
    scale = tl.load(weights_ptr + slot, mask=local, other=0.0).to(tl.float32)
    rows = (tl.where(local, expert, 0).to(tl.int64) * stride_we)[:, None] + offs_n[None, :].to(tl.int64) * stride_wn
    row_mask = local[:, None] & n_mask[None, :]
    acc = tl.zeros((BLOCK_TOPK, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for i0 in tl.static_range(0, INTER, BLOCK_K):  # unrolled: K=I is small, every load issues early
        offs_i = i0 + tl.arange(0, BLOCK_K)
        i_mask = offs_i < INTER
        a = tl.load(act_ptr + slot[:, None] * INTER + offs_i[None, :], mask=local[:, None] & i_mask[None, :],
                    other=0.0).to(tl.float32) * scale[:, None]
        w = tl.load(w2_ptr + rows[:, :, None] + offs_i[None, None, :] * stride_wk,
                    mask=row_mask[:, :, None] & i_mask[None, None, :], other=0.0)
        acc += w.to(tl.float32) * a[:, None, :]
    out = tl.sum(tl.sum(acc, axis=2), axis=0).to(out_ptr.dtype.element_ty)
    if HAS_RESIDUAL:  # the decoder layer's ``residual + out``: out rounded first, the sum rounded once, as torch adds
        res = tl.load(res_ptr + token * hidden + offs_n, mask=n_mask, other=0.0)
        out = (res.to(tl.float32) + out.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * hidden + offs_n, out, mask=n_mask)


def direct_config(num_tokens: int) -> dict:
    """Tile sizes (output rows per program, reduction chunk, warps) of the two kernels.

    Row tiles are small so that even one token spreads over several programs per SM (gate_up:
    K * I / block_n programs; down: H / block_n, each reading its rows of all K experts), and the
    reduction loops are unrolled so each program keeps all its weight loads in flight together;
    the tiles are sized so that the loaded chunks and accumulators fit in registers. ptxas
    (sm_90a, Qwen3-30B-A3B shapes) for the earlier gate_up tile (16 rows, 256, 4 warps): 168
    registers and ~2.5 KB of spills per thread; (4, 512, 8): 80 registers, none; down (2, 256, 4):
    168, none. `fxrewrite.benchmarks.moe_kernels --sweep --direct-only` times the candidates in CUDA
    graphs (TB/s of routed bytes)."""
    del num_tokens  # one config for T <= DIRECT_MAX_TOKENS until the sweep says otherwise
    return dict(gate_up=dict(block_n=4, block_k=512, num_warps=8), down=dict(block_n=2, block_k=256, num_warps=4))


def direct_gate_up(x: torch.Tensor, w13: torch.Tensor, ids: torch.Tensor, top_k: int, expert_start: int,
                   config: dict) -> torch.Tensor:
    """x [T, H] (unit last stride), w13 [E_local, 2I, H], flat ids [T*K] -> act [T*K, I] in x's dtype
    (``silu(gate) * up`` per slot; rows of remote slots are left unwritten). `config`: one entry of
    `direct_config` (block_n, block_k, num_warps)."""
    num_local, two_i, hidden = w13.shape
    inter = two_i // 2
    act = torch.empty(ids.numel(), inter, dtype=x.dtype, device=x.device)
    pdl = pdl_enabled(x.device)
    launch(_direct_gate_up_kernel, (ids.numel(), triton.cdiv(inter, config["block_n"])), x.device, pdl)(
        x, w13, ids, act, expert_start, num_local, x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), inter,
        TOP_K=top_k, HIDDEN=hidden, BLOCK_N=config["block_n"],
        BLOCK_K=min(config["block_k"], triton.next_power_of_2(hidden)), PDL=pdl, num_warps=config["num_warps"])
    return act


def direct_down(act: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
                top_k: int, expert_start: int, config: dict, residual: torch.Tensor | None = None) -> torch.Tensor:
    """act [T*K, I], w2 [E_local, H, I], flat ids and weights [T*K] -> out [T, H] (contiguous, written
    in place and returned): ``sum_k weights[t, k] * w2[ids[t, k]] @ act[t*K + k]`` over local slots, rounded
    to out's dtype; with `residual` ([T, H] contiguous, out's dtype) ``residual + that``, rounded once more."""
    num_local, hidden, inter = w2.shape
    pdl = pdl_enabled(out.device)
    launch(_direct_down_kernel, (out.shape[0], triton.cdiv(hidden, config["block_n"])), out.device, pdl)(
        act, w2, ids, weights, out if residual is None else residual, out, expert_start, num_local, hidden,
        w2.stride(0), w2.stride(1), w2.stride(2), TOP_K=top_k, INTER=inter, BLOCK_TOPK=triton.next_power_of_2(top_k),
        BLOCK_N=config["block_n"], BLOCK_K=min(config["block_k"], triton.next_power_of_2(inter)),
        HAS_RESIDUAL=residual is not None, PDL=pdl, num_warps=config["num_warps"])
    return out


def direct_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, expert_start: int = 0, config: dict | None = None,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `fused_experts_ref` (x [T, H], w13 [E, 2I, H], w2 [E, H, I], routing [T, K]
    -> [T, H] in x's dtype), inference only (no autograd); shapes are checked by the caller. With `residual`
    [T, H] (x's dtype): ``residual + fused_experts_ref(...)``, the add in the down kernel's epilogue."""
    t, k = topk_ids.shape
    cfg = config or direct_config(t)
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    act = direct_gate_up(x, w13, ids, k, expert_start, cfg["gate_up"])
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if residual is not None:
        residual = residual.contiguous()
    return direct_down(act, w2, ids, weights, out, k, expert_start, cfg["down"], residual)
