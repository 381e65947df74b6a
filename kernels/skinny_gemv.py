"""Skinny GEMM for decode (M <= GEMV_MAX_M tokens) on bf16 / fp16 / fp32 weights [N, K] (nn.Linear's
layout), with the neighbouring element-wise kernels fused in as prologues:

- ``norm_weight``: RMSNorm of each input row (optionally after the residual add, the new residual
  written once, by the programs of the first column tile): qkv_proj and gate_up_proj then take the
  un-normalised hidden state and the `_rms_norm_kernel` launch disappears;
- ``silu_mul``: the input is gate_up's output [M, 2K]; silu(gate) * up is computed on the fly (rounded to
  the input dtype, as the separate kernel stores it), so down_proj runs without `_act_and_mul_kernel`.

Decode is bound by the weight stream (every weight byte read once per step). Each program owns
BLOCK_N output rows and all M tokens, streams [BLOCK_N, BLOCK_K] weight tiles along K (16-byte vector
loads), and keeps a float32 [BLOCK_M, BLOCK_N, BLOCK_K] accumulator of products that is reduced over K
once, after the loop (as Inductor's GEMV reductions do): no cross-thread reduction per step. Small
BLOCK_N (1-8 rows) gives N / BLOCK_N >= 320 programs even for o_proj / down_proj (N = hidden size), so
the 132 SMs fill without split-K and without a second reduction kernel. The RMSNorm factor is applied
after the dot: sum_k w[n,k] * x[k] * g[k] * rstd = rstd * sum_k w[n,k] * (x[k] * g[k]), so the sum of
squares accumulates in the same pass (every program recomputes it: x is a few KB, read from L1/L2).

Reference `skinny_gemv_ref`: the unfused ops (rms_norm_ref / silu_and_mul_ref, then F.linear), which is
what the model runs without this kernel. Formulas: RMSNorm as transformers' LlamaRMSNorm, SiLU-and-mul
as its LlamaMLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxrewrite.kernels.activation import silu_and_mul_ref
from fxrewrite.kernels.rms_norm import rms_norm_ref
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["GEMV_MAX_M", "CONFIGS", "skinny_gemv_ref", "skinny_gemv_triton", "configs_for"]

GEMV_MAX_M = 8
"""Largest token count: each token adds M float32 accumulators per weight element a thread holds."""
CONFIGS = {
    1: ((4, 512, 4), (8, 512, 4), (2, 1024, 4), (8, 1024, 8)),
    2: ((4, 512, 4), (2, 512, 4), (8, 512, 8)),
    4: ((2, 512, 4), (4, 256, 4), (4, 512, 8)),
    8: ((2, 256, 4), (1, 512, 4), (2, 512, 8)),
}
"""(block_n, block_k, num_warps) candidates by padded token count BLOCK_M: 8-32 float32 accumulators
per thread and token block, 16-64 bytes of weight in flight per thread and loop step."""


def configs_for(m: int) -> tuple[tuple[int, int, int], ...]:
    """The candidate configs for m tokens (1 <= m <= GEMV_MAX_M; ValueError otherwise)."""
    if not 1 <= m <= GEMV_MAX_M:
        raise ValueError(f"skinny GEMV takes 1..{GEMV_MAX_M} rows, got {m}")
    return CONFIGS[next_power_of_2(m)]


def _check(x: torch.Tensor, w: torch.Tensor, norm_weight, residual, silu_mul: bool) -> int:
    k = w.shape[1]
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != (2 * k if silu_mul else k):
        want = f"[M, {2 * k}] (gate | up)" if silu_mul else f"[M, {k}]"
        raise ValueError(f"skinny_gemv: x {tuple(x.shape)} does not fit weight {tuple(w.shape)}; expected {want}")
    if silu_mul and norm_weight is not None:
        raise ValueError("skinny_gemv: silu_mul and norm_weight are exclusive prologues")
    if residual is not None and (norm_weight is None or residual.shape != x.shape):
        raise ValueError(f"skinny_gemv: residual {tuple(residual.shape)} needs norm_weight and x's shape "
                         f"{tuple(x.shape)}")
    return k


def skinny_gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                    norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                    residual: torch.Tensor | None = None, silu_mul: bool = False):
    """Torch reference. x [M, K] (or [M, 2K] with silu_mul), w [N, K], bias [N] or None, all one float dtype.

    norm_weight [K]: x -> rms_norm(x (+ residual)) first; with residual [M, K] returns (out, x + residual),
    else out [M, N]. silu_mul: x -> silu(x[:, :K]) * x[:, K:] first. ValueError on shapes that do not fit."""
    _check(x, w, norm_weight, residual, silu_mul)
    if silu_mul:
        return F.linear(silu_and_mul_ref(x), w, bias)
    if norm_weight is None:
        return F.linear(x, w, bias)
    normed = rms_norm_ref(x, norm_weight, eps, residual)
    if residual is None:
        return F.linear(normed, w, bias)
    return F.linear(normed[0], w, bias), normed[1]


def skinny_gemv_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                       norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                       residual: torch.Tensor | None = None, silu_mul: bool = False,
                       config: tuple[int, int, int] | None = None):
    """The Triton kernel; same contract as `skinny_gemv_ref` (M <= GEMV_MAX_M, else ValueError).
    config: (block_n, block_k, num_warps), default the first of `configs_for(M)`."""
    k = _check(x, w, norm_weight, residual, silu_mul)
    m, n = x.shape[0], w.shape[0]
    block_n, block_k, num_warps = config or configs_for(m)[0]
    configs_for(m)  # range check
    if x.stride(1) != 1 or not w.is_contiguous():
        raise ValueError(f"skinny_gemv: needs x with unit column stride and a contiguous weight; got strides "
                         f"{x.stride()} and {w.stride()}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else out
    res_in = residual if residual is not None else x
    if res_in.stride(1) != 1:
        res_in = res_in.contiguous()
    block_k = min(block_k, next_power_of_2(k))
    launch(_skinny_gemv_kernel, (triton.cdiv(n, block_n),), x.device)(
        x, res_in, norm_weight if norm_weight is not None else w, w, bias if bias is not None else w, out, res_out,
        m, n, k, x.stride(0), res_in.stride(0), float(eps),
        BLOCK_M=next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm_weight is not None,
        HAS_RES=residual is not None, SILU_MUL=silu_mul, HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0,
        num_warps=num_warps,
    )
    return (out, res_out) if residual is not None else out


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _skinny_gemv_kernel(x_ptr, res_ptr, g_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, M, N, K, stride_xm, stride_rm,
                        eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        NORM: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr,
                        EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rows = tl.minimum(rm, M - 1)  # padded token rows re-read the last one: loads stay unmasked along M
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * K  # same for a partial last N tile
    rk0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    ss = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + rk0
        k_ok = rk[None, :] < K
        x_offs = rows[:, None] * stride_xm + rk[None, :]
        if SILU_MUL:
            gate = _load(x_ptr + x_offs, k_ok, EVEN_K).to(tl.float32)
            up = _load(x_ptr + x_offs + K, k_ok, EVEN_K).to(tl.float32)
            # rounded as the separate activation kernel stores it
            x = (gate * tl.sigmoid(gate) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            xv = _load(x_ptr + x_offs, k_ok, EVEN_K)
            if HAS_RES:
                r = _load(res_ptr + rows[:, None] * stride_rm + rk[None, :], k_ok, EVEN_K)
                xv = (xv.to(tl.float32) + r.to(tl.float32)).to(xv.dtype)  # one rounding, as a bf16 add
                if pid == 0:
                    tl.store(res_out_ptr + rm[:, None] * K + rk[None, :], xv, mask=(rm[:, None] < M) & k_ok)
            x = xv.to(tl.float32)
            if NORM:
                ss += x * x
                x = x * _load(g_ptr + rk, rk < K, EVEN_K).to(tl.float32)[None, :]
        w = _load(w_rows + rk[None, :], k_ok, EVEN_K).to(tl.float32)
        acc += w[None, :, :] * x[:, None, :]
    out = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    if NORM:
        out = out * tl.rsqrt(tl.sum(ss, axis=1) / K + eps)[:, None]
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))
