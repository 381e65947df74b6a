"""Block-scaled FP8 matrix-vector products for decode (M <= GEMV_MAX_M tokens): a Triton kernel without
tensor cores that reads the FP8 weight once, the load-time tuner's (fp8_tune.py) candidate at small M.

Decode is bound by the weight stream: every step reads each weight byte once, so the kernel must keep
enough bytes in flight and never re-read the weight per token. Each program owns BLOCK_N output rows
and all the tokens (<= 4, unrolled), and per loop step loads a [BLOCK_N, GROUPS_PER_STEP, 128] slab of
FP8 weight (contiguous along K: 16-byte vector loads), converts it to float32 once, and reduces it
against every token's activations; the weight scale of each 128-column group multiplies that group's
partial sums. K is split over programs (float32 partials, summed after) until about `target_programs`
are in flight, which o_proj / down_proj need (N = hidden size: too few row tiles to fill 132 SMs).

Two activation forms, both float32-accumulated:

- weight-only (``a_s`` None; a in bf16 / fp16 / fp32): out[m, n] = sum_g w_s[n, g] * sum_{k in g}
  a[m, k] * w[n, k]: no activation quantization kernel runs before it (the dispatcher's default at
  decode); reference `fp8_weight_only_gemv_ref`;
- W8A8 (a FP8 with per-token-group scales a_s): the contract of
  `fxrewrite.kernels.fp8_gemm.fp8_block_gemm_ref` (`fp8_block_gemv_ref`), the a_s[m, g] factor added.
"""

from __future__ import annotations

import torch

from fxrewrite.kernels.fp8_gemm import fp8_block_gemm_ref as fp8_block_gemv_ref
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["fp8_block_gemv_triton", "fp8_block_gemv_ref", "fp8_weight_only_gemv_ref", "GEMV_MAX_M",
           "GEMV_CONFIGS"]

GEMV_MAX_M = 4
"""Largest token count the kernel takes: every token adds float32 multiply-adds per weight byte, and
from about 4 tokens the FP8 tensor-core kernels win (they do the math for free while the weight streams)."""
GEMV_CONFIGS = ((16, 1024, 4), (32, 1024, 2), (8, 2048, 4), (8, 2048, 8))
"""(block_n, target_programs, groups_per_step) candidates the tuner times: 4-8 KB of weight per program
and loop step; the smaller the slab, the more programs fit an SM (more loads in flight in all)."""


def fp8_weight_only_gemv_ref(a: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, group_size: int = 128,
                             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Torch reference of the weight-only form: a [M, K] float @ (w [N, K] fp8 * w_s [N, ceil(K/group)]
    expanded over each group)^T in float32 -> [M, N] out_dtype."""
    k = a.shape[1]
    wf = w.float() * w_s.float().repeat_interleave(group_size, dim=1)[:, :k]
    return (a.float() @ wf.t()).to(out_dtype)


def fp8_block_gemv_triton(a: torch.Tensor, a_s: torch.Tensor | None, w: torch.Tensor, w_s: torch.Tensor,
                          out_dtype: torch.dtype = torch.bfloat16, block_n: int = 16,
                          target_programs: int = 1024, groups_per_step: int = 4) -> torch.Tensor:
    """a [M, K] (FP8 with a_s [M, ceil(K/128)] float32, or bf16/fp16/fp32 with a_s None), w [N, K] fp8,
    w_s [N, ceil(K/128)] float32; scales in any strides -> [M, N] out_dtype. M <= GEMV_MAX_M (ValueError
    otherwise). K splits: min(ceil(groups / groups_per_step), target_programs // row tiles)."""
    m, k = a.shape
    if m > GEMV_MAX_M or a.stride(1) != 1:
        raise ValueError(f"fp8_block_gemv_triton takes at most {GEMV_MAX_M} rows with unit column stride; "
                         f"got a {tuple(a.shape)} with strides {a.stride()}")
    n, groups = w.shape[0], w_s.shape[1]
    tiles = triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(groups, groups_per_step), target_programs // tiles))
    per_split = triton.cdiv(triton.cdiv(groups, split), groups_per_step) * groups_per_step  # whole steps
    split = triton.cdiv(groups, per_split)  # no empty split
    out = torch.empty((split, m, n), dtype=torch.float32 if split > 1 else out_dtype, device=a.device)
    has_a_s = a_s is not None
    a_s = a_s if has_a_s else w_s  # unread placeholder
    launch(_gemv_kernel, (tiles, split), a.device)(
        a, a_s, w, w_s, out, m, n, k, groups, per_split, a.stride(0), a_s.stride(0), a_s.stride(1),
        w_s.stride(0), w_s.stride(1),
        BLOCK_M=next_power_of_2(m), BLOCK_N=block_n, GROUP_K=128, STEP=groups_per_step, HAS_A_SCALE=has_a_s,
        EVEN_K=k % 128 == 0, num_warps=4,
    )
    return out[0] if split == 1 else out.sum(0).to(out_dtype)


@triton.jit
def _gemv_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, G, GROUPS_PER_SPLIT, stride_am, stride_as_m,
                 stride_as_g, stride_ws_n, stride_ws_g, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUP_K: tl.constexpr, STEP: tl.constexpr, HAS_A_SCALE: tl.constexpr, EVEN_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, STEP)
    rk = tl.arange(0, GROUP_K)
    rm = tl.arange(0, BLOCK_M)
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    g_start = pid_k * GROUPS_PER_SPLIT
    g_end = tl.minimum(g_start + GROUPS_PER_SPLIT, G)
    for g0 in range(g_start, g_end, STEP):
        gs = g0 + rs
        g_mask = gs < g_end
        k = gs[:, None] * GROUP_K + rk[None, :]  # [STEP, 128]
        if EVEN_K:
            k_mask = g_mask[:, None]  # [STEP, 1]: broadcast along K, so the loads stay 16-byte vectors
        else:
            k_mask = g_mask[:, None] & (k < K)
        w = tl.load(w_ptr + rn[:, None, None] * K + k[None, :, :], mask=n_mask[:, None, None] & k_mask[None, :, :],
                    other=0.0).to(tl.float32)  # [BLOCK_N, STEP, 128], one pass over the weight
        w_s = tl.load(ws_ptr + rn[:, None] * stride_ws_n + gs[None, :] * stride_ws_g,
                      mask=n_mask[:, None] & g_mask[None, :], other=0.0)  # [BLOCK_N, STEP]
        for i in tl.static_range(BLOCK_M):  # every token against the same weight registers
            row_ok = tl.full((1,), i, tl.int32) < M  # a tensor (the interpreter cannot mask with a bool)
            a = tl.load(a_ptr + i * stride_am + k, mask=k_mask & row_ok, other=0.0).to(tl.float32)
            part = tl.sum(w * a[None, :, :], axis=2) * w_s  # [BLOCK_N, STEP]
            if HAS_A_SCALE:
                a_s = tl.load(as_ptr + i * stride_as_m + gs * stride_as_g, mask=g_mask & row_ok, other=0.0)
                part = part * a_s[None, :]
            acc += tl.where(rm[:, None] == i, tl.sum(part, axis=1)[None, :], 0.0)
    out = out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & n_mask[None, :])
