"""Block-scaled FP8 matrix-vector products for decode (M <= 16 tokens): a Triton kernel without tensor
cores, the candidate the load-time tuner (fp8_dispatch.py) weighs against the tiled GEMM at small M.

At M = 1 the tiled kernel pads the token dimension to a 16-row MMA tile and the weight stream, which
sets decode speed, stalls behind it (the 2026-11-30 H200 run: ~250 GB/s against bf16's ~1.9 TB/s).
Here each program streams a [BLOCK_N, 128] slab of the FP8 weight per scale group, converts it to
float32, and reduces it against one token's 128 activations (a multiply and a row sum), K split over
programs until about `target_programs` are in flight. Same contract and reference as
`fxrewrite.kernels.fp8_gemm.fp8_block_gemm_ref`:

out[m, n] = sum_g a_s[m, g] * w_s[n, g] * sum_{k in group g} a[m, k] * w[n, k]   (float32 accumulate)
"""

from __future__ import annotations

import torch

from fxrewrite.kernels.fp8_gemm import fp8_block_gemm_ref as fp8_block_gemv_ref
from fxrewrite.kernels.triton_utils import launch, tl, triton

__all__ = ["fp8_block_gemv_triton", "fp8_block_gemv_ref", "GEMV_MAX_M", "GEMV_CONFIGS"]

GEMV_MAX_M = 16
"""Largest token count the tuner tries this kernel at (the weight is re-read once per token)."""
GEMV_CONFIGS = ((32, 1024), (64, 512))
"""(block_n, target_programs) candidates."""


def fp8_block_gemv_triton(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
                          out_dtype: torch.dtype = torch.bfloat16, block_n: int = 32,
                          target_programs: int = 1024) -> torch.Tensor:
    """a [M, K] fp8, a_s [M, ceil(K/128)] float32 (any strides), w [N, K] fp8, w_s [N, ceil(K/128)]
    float32 (any strides) -> [M, N] out_dtype. K splits: min(groups, target_programs // (N tiles * M))."""
    m, k = a.shape
    n, groups = w.shape[0], a_s.shape[1]
    tiles = triton.cdiv(n, block_n) * m
    split = max(1, min(groups, target_programs // tiles))
    per_split = triton.cdiv(groups, split)
    split = triton.cdiv(groups, per_split)  # no empty split
    out = torch.empty((split, m, n), dtype=torch.float32 if split > 1 else out_dtype, device=a.device)
    launch(_gemv_kernel, (triton.cdiv(n, block_n), m, split), a.device)(
        a, a_s, w, w_s, out, m, n, k, groups, per_split, a_s.stride(0), a_s.stride(1), w_s.stride(0), w_s.stride(1),
        BLOCK_N=block_n, BLOCK_K=128, EVEN_K=k % 128 == 0, num_warps=4,
    )
    return out[0] if split == 1 else out.sum(0).to(out_dtype)


@triton.jit
def _gemv_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, G, GROUPS_PER_SPLIT, stride_as_m, stride_as_g,
                 stride_ws_n, stride_ws_g, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    g_start = pid_k * GROUPS_PER_SPLIT
    g_end = tl.minimum(g_start + GROUPS_PER_SPLIT, G)
    for g in range(g_start, g_end):
        k = g * BLOCK_K + rk
        if EVEN_K:
            a = tl.load(a_ptr + row * K + k).to(tl.float32)
            w = tl.load(w_ptr + rn[:, None] * K + k[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
        else:
            k_mask = k < K
            a = tl.load(a_ptr + row * K + k, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rn[:, None] * K + k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                        other=0.0).to(tl.float32)
        a_s = tl.load(as_ptr + row * stride_as_m + g * stride_as_g)
        w_s = tl.load(ws_ptr + rn * stride_ws_n + g * stride_ws_g, mask=n_mask, other=0.0)
        acc += tl.sum(w * a[None, :], axis=1) * (a_s * w_s)
    tl.store(out_ptr + pid_k * M * N + row * N + rn, acc.to(out_ptr.dtype.element_ty), mask=n_mask)
