"""Skinny GEMM for decode (M <= GEMV_MAX_M tokens) on bf16 / fp16 / fp32 weights [N, K] (nn.Linear's
layout), with the neighbouring element-wise kernels fused in as prologues:

- ``norm_weight``: RMSNorm of each input row (optionally after the residual add, the new residual
  written once, by the programs of the first column tile): qkv_proj and gate_up_proj then take the
  un-normalised hidden state and the `_rms_norm_kernel` launch disappears;
- ``silu_mul``: the input is gate_up's output [M, 2K]; silu(gate) * up is computed on the fly (rounded to
  the input dtype, as the separate kernel stores it), so down_proj runs without `_act_and_mul_kernel`.

and one epilogue: ``out_residual`` [M, N] is added to the output (rounded to the output dtype first, then once
more after the add, as torch's ``out_residual + linear(x)`` rounds): a decoder layer's closing residual add rides
in down_proj (the rewritten transformers layers, `fxrewrite.layers.layernorm.RMSNorm.forward_mlp`) instead of
its own launch.

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
from fxrewrite.kernels.pdl import LINE_BYTES, gdc_prologue, pdl_enabled, prefetch_l2, prefetch_lines
from fxrewrite.kernels.rms_norm import rms_norm_ref
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["GEMV_MAX_M", "CONFIGS", "SPLIT_CONFIGS", "SPLIT_MAX_TILES", "FP8_CONFIGS", "FORMATS", "skinny_gemv_ref",
           "skinny_gemv_triton", "configs_for"]

GEMV_MAX_M = 8
"""Largest token count: each token adds M float32 accumulators per weight element a thread holds."""
CONFIGS = {
    1: ((4, 512, 2), (8, 512, 2), (2, 1024, 2), (4, 1024, 2)),
    2: ((4, 512, 2), (2, 512, 2), (2, 1024, 2)),
    4: ((2, 512, 2), (4, 512, 2), (1, 1024, 2)),
    8: ((1, 512, 2), (2, 512, 2), (1, 1024, 2)),
}
"""(block_n, block_k, num_warps) candidates by padded token count BLOCK_M. block_k is a multiple of 256 *
num_warps: every thread owns whole 8-column groups (16-byte bf16 loads, block_k / 256 / num_warps per row)
of each of the block_n rows, so an input slice [block_k] is laid out as the weight tile's columns already
(no shared-memory shuffle, no barrier in the loop); block_n * block_k / (32 * num_warps) * BLOCK_M float32
accumulators per thread (32-64)."""
SPLIT_CONFIGS = {
    1: ((8, 512, 2, 4), (16, 512, 4, 8), (4, 512, 2, 4)),
    2: ((4, 512, 2, 4), (8, 512, 4, 4)),
}
"""(block_n, block_k, num_warps, split_k) candidates for the kinds without a norm prologue ("linear",
"silu") at 1-2 tokens: a narrow output (o_proj / down_proj, N = hidden size) gives N / block_n programs, too
few warps in flight to keep HBM busy (Qwen3-4B down_proj: 640 x 2 warps, ~4.8 per SM); split-K multiplies
them, and a wider block_n reads the SiLU-and-mul input (recomputed by every program) fewer times. The programs
of a column tile write float32 partials; the last to arrive (an atomic ticket) sums them in split order."""
SPLIT_MAX_TILES = 1024
"""Split-K is a candidate only when the output has fewer column tiles than this (~8 programs per SM of an
H100 / H200): a wide output (gate_up, an LM head) fills the GPU without it, and each candidate costs a build."""


FP8_CONFIGS = {
    1: ((4, 8, 4), (4, 8, 2), (8, 4, 2), (8, 4, 4), (8, 8, 4), (4, 4, 2), (2, 8, 2), (16, 4, 4), (4, 16, 8)),
    2: ((4, 4, 2), (4, 8, 4), (8, 4, 4), (2, 8, 2), (8, 8, 8)),
    4: ((2, 4, 2), (4, 4, 4), (2, 8, 4), (4, 8, 8), (1, 8, 2)),
    8: ((1, 4, 2), (2, 4, 4), (1, 8, 4), (2, 8, 8), (4, 4, 8)),
}
"""FP8 weights (`fxrewrite.kernels.skinny_gemv_fp8`): (block_n, block_g, num_warps), block_g groups of 128
columns per loop step. One byte per weight: twice the bf16 kernel's columns for the same bytes in flight;
block_n * block_g * 128 / (32 * num_warps) * BLOCK_M float32 accumulators per thread (16-128). Not
measured before being listed: the load-time tuner (`fxrewrite.kernels.gemv_tune`) times every one."""
FORMATS = ("float", "fp8", "fp8-channel")
"""Weight formats: bf16 / fp16 / fp32 ("float"), FP8 with a scale per row and 128 columns ("fp8"), FP8 with
one scale per row ("fp8-channel")."""


def configs_for(m: int, kind: str = "norm", n: int | None = None, fmt: str = "float") -> tuple[tuple[int, ...], ...]:
    """The candidate configs for m tokens (1 <= m <= GEMV_MAX_M) and a weight format of `FORMATS` (ValueError
    otherwise). "float": `CONFIGS`, then for kind "linear" / "silu" the split-K ones of `SPLIT_CONFIGS` (with
    `n` output rows: those that leave fewer than `SPLIT_MAX_TILES` column tiles); FP8: `FP8_CONFIGS`."""
    if not 1 <= m <= GEMV_MAX_M:
        raise ValueError(f"skinny GEMV takes 1..{GEMV_MAX_M} rows, got {m}")
    if fmt not in FORMATS:
        raise ValueError(f"skinny GEMV weight format {fmt!r}; expected one of {FORMATS}")
    bucket = next_power_of_2(m)
    if fmt != "float":
        return FP8_CONFIGS[bucket]
    split = SPLIT_CONFIGS.get(bucket, ()) if kind in ("linear", "silu") else ()
    return CONFIGS[bucket] + tuple(c for c in split if n is None or -(-n // c[0]) < SPLIT_MAX_TILES)


def _check(x: torch.Tensor, w: torch.Tensor, norm_weight, residual, silu_mul: bool, out_residual=None) -> int:
    k = w.shape[1]
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != (2 * k if silu_mul else k):
        want = f"[M, {2 * k}] (gate | up)" if silu_mul else f"[M, {k}]"
        raise ValueError(f"skinny_gemv: x {tuple(x.shape)} does not fit weight {tuple(w.shape)}; expected {want}")
    if silu_mul and norm_weight is not None:
        raise ValueError("skinny_gemv: silu_mul and norm_weight are exclusive prologues")
    if norm_weight is not None and (tuple(norm_weight.shape) != (k,) or norm_weight.stride(0) != 1):
        raise ValueError(f"skinny_gemv: norm_weight {tuple(norm_weight.shape)} strides {norm_weight.stride()}; "
                         f"expected a contiguous ({k},) (the kernels read it as K consecutive values)")
    if residual is not None and (norm_weight is None or residual.shape != x.shape):
        raise ValueError(f"skinny_gemv: residual {tuple(residual.shape)} needs norm_weight and x's shape "
                         f"{tuple(x.shape)}")
    if out_residual is not None and (tuple(out_residual.shape) != (x.shape[0], w.shape[0])
                                     or out_residual.dtype != x.dtype):
        raise ValueError(f"skinny_gemv: out_residual {tuple(out_residual.shape)} {out_residual.dtype}; expected the "
                         f"output's shape {(x.shape[0], w.shape[0])} and dtype {x.dtype}")
    return k


def skinny_gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                    norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                    residual: torch.Tensor | None = None, silu_mul: bool = False,
                    out_residual: torch.Tensor | None = None):
    """Torch reference. x [M, K] (or [M, 2K] with silu_mul), w [N, K], bias [N] or None, all one float dtype.

    norm_weight [K]: x -> rms_norm(x (+ residual)) first; with residual [M, K] returns (out, x + residual),
    else out [M, N]. silu_mul: x -> silu(x[:, :K]) * x[:, K:] first. out_residual [M, N] of x's dtype: out is
    ``out_residual + out``. ValueError on shapes that do not fit."""
    _check(x, w, norm_weight, residual, silu_mul, out_residual)

    def linear(h):
        out = F.linear(h, w, bias)
        return out if out_residual is None else out_residual + out

    if silu_mul:
        return linear(silu_and_mul_ref(x))
    if norm_weight is None:
        return linear(x)
    normed = rms_norm_ref(x, norm_weight, eps, residual)
    if residual is None:
        return linear(normed)
    return linear(normed[0]), normed[1]


def skinny_gemv_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                       norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                       residual: torch.Tensor | None = None, silu_mul: bool = False,
                       out_residual: torch.Tensor | None = None, config: tuple[int, ...] | None = None):
    """The Triton kernel; same contract as `skinny_gemv_ref` (M <= GEMV_MAX_M, else ValueError).
    config: (block_n, block_k, num_warps[, split_k]), default the first of `configs_for(M)`; split_k > 1
    only without norm_weight (ValueError). Launched with PDL where `fxrewrite.kernels.pdl` enables it."""
    k = _check(x, w, norm_weight, residual, silu_mul, out_residual)
    m, n = x.shape[0], w.shape[0]
    block_n, block_k, num_warps, *split = config or configs_for(m)[0]
    configs_for(m)  # range check
    if x.stride(1) != 1 or not w.is_contiguous():
        raise ValueError(f"skinny_gemv: needs x with unit column stride and a contiguous weight; got strides "
                         f"{x.stride()} and {w.stride()}")
    if split and split[0] > 1 and norm_weight is not None:
        raise ValueError(f"skinny_gemv: config {config} splits K, which the RMSNorm prologue cannot (needs all of K)")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else out
    res_in = residual if residual is not None else x
    if res_in.stride(1) != 1:
        res_in = res_in.contiguous()
    if out_residual is not None and not out_residual.is_contiguous():
        out_residual = out_residual.contiguous()
    block_k = min(block_k, next_power_of_2(k))
    tiles = triton.cdiv(k, block_k)
    per_split = triton.cdiv(tiles, split[0] if split else 1)
    splits = triton.cdiv(tiles, per_split)  # no empty split: each program's first tile is in range
    n_tiles, block_m = triton.cdiv(n, block_n), next_power_of_2(m)
    ws = torch.empty(splits * block_m * n, dtype=torch.float32, device=x.device) if splits > 1 else out
    tickets = _tickets(x.device, n_tiles) if splits > 1 else out
    pdl = pdl_enabled(x.device)
    launch(_skinny_gemv_kernel, (n_tiles, splits), x.device, pdl)(
        x, res_in, norm_weight if norm_weight is not None else w, w, bias if bias is not None else w, out, res_out,
        out_residual if out_residual is not None else out, ws, tickets, m, n, k, per_split * block_k, x.stride(0),
        res_in.stride(0), float(eps), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm_weight is not None,
        HAS_RES=residual is not None, SILU_MUL=silu_mul, HAS_BIAS=bias is not None,
        ADD_OUT=out_residual is not None, EVEN_K=k % block_k == 0, SPLIT_K=splits, PDL=pdl,
        PREFETCH_LINES=prefetch_lines(per_split * block_k, w.element_size()), LINE=LINE_BYTES // w.element_size(),
        num_warps=num_warps,
    )
    return (out, res_out) if residual is not None else out


_TICKETS: dict[torch.device, torch.Tensor] = {}


def _tickets(device: torch.device, count: int) -> torch.Tensor:
    """The device's split-K arrival counters (int32, zero between calls: each call's last program resets its
    own), at least `count`. One set per device: split-K calls must not run concurrently on two streams.
    Allocated outside CUDA-graph capture (the first eager call, e.g. the capture's warm-up, does it)."""
    buf = _TICKETS.get(device)
    if buf is None or buf.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny_gemv: split-K counters must be allocated before CUDA-graph capture; run "
                               "the call once eagerly first")
        buf = _TICKETS[device] = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
    return buf


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _token(x_ptr, res_ptr, g_ptr, res_out_ptr, i, rk, M, K, stride_xm, stride_rm, write_res,
           NORM: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr):
    """Token i's input slice [BLOCK_K] as float32, prologue applied (without the norm's 1/rms), and its
    squares for the norm. Token rows past M re-read row M - 1 (their outputs are not stored)."""
    row = tl.minimum(i, M - 1)
    k_ok = rk < K
    if SILU_MUL:
        gate = _load(x_ptr + row * stride_xm + rk, k_ok, EVEN_K).to(tl.float32)
        up = _load(x_ptr + row * stride_xm + K + rk, k_ok, EVEN_K).to(tl.float32)
        # rounded as the separate activation kernel stores it
        x = (gate * tl.sigmoid(gate) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        sq = x
    else:
        xv = _load(x_ptr + row * stride_xm + rk, k_ok, EVEN_K)
        if HAS_RES:
            r = _load(res_ptr + row * stride_rm + rk, k_ok, EVEN_K)
            xv = (xv.to(tl.float32) + r.to(tl.float32)).to(xv.dtype)  # one rounding, as a bf16 add
            if write_res:
                row_ok = tl.full((1,), i, tl.int32) < M  # a tensor: the interpreter masks with no Python bool
                tl.store(res_out_ptr + i * K + rk, xv, mask=k_ok & row_ok)
        x = xv.to(tl.float32)
        sq = x * x
        if NORM:
            x = x * _load(g_ptr + rk, k_ok, EVEN_K).to(tl.float32)
    return x, sq


@triton.jit
def add_out_residual(out, add_ptr, offsets, mask, dtype: tl.constexpr, ADD_OUT: tl.constexpr):
    """The output row (float32) rounded to `dtype`, plus the epilogue's addend when ADD_OUT, rounded again (torch's
    ``addend + linear(x)``: two rounded results); the value to store."""
    out = out.to(dtype)
    if ADD_OUT:
        out = (out.to(tl.float32) + tl.load(add_ptr + offsets, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    return out


@triton.jit
def _store_row(out_ptr, b_ptr, add_ptr, acc, ss, i, rn, M, N, K, eps, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
               ADD_OUT: tl.constexpr):
    out = tl.sum(acc, axis=1)  # [BLOCK_N]: the one reduction over K
    if NORM:
        out = out * tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    row_ok = tl.full((1,), i, tl.int32) < M
    mask = (rn < N) & row_ok
    tl.store(out_ptr + i * N + rn, add_out_residual(out, add_ptr, i * N + rn, mask, out_ptr.dtype.element_ty, ADD_OUT),
             mask=mask)


@triton.jit
def _fma(acc, ss, w, i, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, M, K, stride_xm, stride_rm, write_res,
         NORM: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr):
    """Token i's accumulator += w * x_i (elementwise over the [BLOCK_N, BLOCK_K] tile); ss += x_i^2 (norm)."""
    x, sq = _token(x_ptr, res_ptr, g_ptr, res_out_ptr, i, rk, M, K, stride_xm, stride_rm, write_res,
                   NORM, HAS_RES, SILU_MUL, EVEN_K)
    if NORM:
        ss = ss + sq
    return acc + w * x[None, :], ss



@triton.jit
def _tile(a0, a1, a2, a3, a4, a5, a6, a7, s0, s1, s2, s3, s4, s5, s6, s7, w, rk, x_ptr, res_ptr, g_ptr,
          res_out_ptr, M, K, stride_xm, stride_rm, first, BLOCK_M: tl.constexpr, NORM: tl.constexpr,
          HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr):
    """Every token's accumulators += the weight tile w [BLOCK_N, BLOCK_K] * its input slice at columns rk."""
    a0, s0 = _fma(a0, s0, w, 0, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, M, K, stride_xm, stride_rm, first,
                  NORM, HAS_RES, SILU_MUL, EVEN_K)
    if BLOCK_M > 1:
        a1, s1 = _fma(a1, s1, w, 1, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, M, K, stride_xm, stride_rm, first,
                      NORM, HAS_RES, SILU_MUL, EVEN_K)
    if BLOCK_M > 2:
        a2, s2 = _fma(a2, s2, w, 2, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, M, K, stride_xm, stride_rm, first,
                      NORM, HAS_RES, SILU_MUL, EVEN_K)
        a3, s3 = _fma(a3, s3, w, 3, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, M, K, stride_xm, stride_rm, first,
                      NORM, HAS_RES, SILU_MUL, EVEN_K)
    if BLOCK_M > 4:
        a4, s4 = _fma(a4, s4, w, 4, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, M, K, stride_xm, stride_rm, first,
                      NORM, HAS_RES, SILU_MUL, EVEN_K)
        a5, s5 = _fma(a5, s5, w, 5, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, M, K, stride_xm, stride_rm, first,
                      NORM, HAS_RES, SILU_MUL, EVEN_K)
        a6, s6 = _fma(a6, s6, w, 6, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, M, K, stride_xm, stride_rm, first,
                      NORM, HAS_RES, SILU_MUL, EVEN_K)
        a7, s7 = _fma(a7, s7, w, 7, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, M, K, stride_xm, stride_rm, first,
                      NORM, HAS_RES, SILU_MUL, EVEN_K)
    return a0, a1, a2, a3, a4, a5, a6, a7, s0, s1, s2, s3, s4, s5, s6, s7


@triton.jit
def _emit(out_ptr, b_ptr, add_ptr, ws_ptr, acc, ss, i, rn, pid_k, M, N, K, eps, BLOCK_M: tl.constexpr,
          NORM: tl.constexpr, HAS_BIAS: tl.constexpr, ADD_OUT: tl.constexpr, SPLIT_K: tl.constexpr):
    """Token i's result: the output row (one split), or this split's float32 partial sums."""
    if SPLIT_K == 1:
        _store_row(out_ptr, b_ptr, add_ptr, acc, ss, i, rn, M, N, K, eps, NORM, HAS_BIAS, ADD_OUT)
    else:
        tl.store(ws_ptr + (pid_k * BLOCK_M + i) * N + rn, tl.sum(acc, axis=1), mask=rn < N)


@triton.jit
def _finish(out_ptr, b_ptr, add_ptr, ws_ptr, cnt_ptr, pid, rn, M, N, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr,
            HAS_BIAS: tl.constexpr, ADD_OUT: tl.constexpr):
    """Split-K: the last program of a column tile to arrive sums the partials in split order (deterministic)."""
    tl.debug_barrier()  # every thread's partial stores precede the release below (as a grid barrier does)
    ticket = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")
    if ticket == SPLIT_K - 1:
        for i in tl.static_range(BLOCK_M):
            total = tl.load(ws_ptr + i * N + rn, mask=rn < N, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(ws_ptr + (s * BLOCK_M + i) * N + rn, mask=rn < N, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
            mask = (rn < N) & (tl.full((1,), i, tl.int32) < M)
            tl.store(out_ptr + i * N + rn,
                     add_out_residual(total, add_ptr, i * N + rn, mask, out_ptr.dtype.element_ty, ADD_OUT), mask=mask)
        tl.atomic_xchg(cnt_ptr + pid, 0)  # ready for the next call (stream-ordered: it gdc_waits first)


@triton.jit
def _skinny_gemv_kernel(x_ptr, res_ptr, g_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, add_ptr, ws_ptr, cnt_ptr, M, N,
                        K, k_split, stride_xm, stride_rm, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr,
                        HAS_BIAS: tl.constexpr, ADD_OUT: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr,
                        PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr):
    # One [BLOCK_N, BLOCK_K] float32 accumulator per token, in the weight tile's own layout (elementwise
    # FMAs, no per-step reduction); tokens past BLOCK_M are pruned at compile time. Program (pid, pid_k)
    # covers columns [pid_k * k_split, +k_split) (all of K with one split).
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * K  # a partial last tile re-reads row N - 1
    rk0 = tl.arange(0, BLOCK_K)
    k_lo = 0
    k_hi = K
    if SPLIT_K > 1:
        k_lo = pid_k * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
    if PDL:
        # weights are never written by a kernel: start this program's first weight tiles towards L2 while the
        # previous kernel finishes, then wait for it (its outputs are this kernel's inputs)
        lines = k_lo + tl.arange(0, PREFETCH_LINES) * LINE
        prefetch_l2(w_rows + lines[None, :], (lines < k_hi)[None, :] & (rn < N)[:, None])
    gdc_prologue(PDL)
    first = pid == 0  # the programs of the first column tile write the new residual (never split: NORM)
    a0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
    s0 = tl.zeros((BLOCK_K,), dtype=tl.float32)
    s1, s2, s3, s4, s5, s6, s7 = s0, s0, s0, s0, s0, s0, s0
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + rk0
        w = _load(w_rows + rk[None, :], (rk < K)[None, :], EVEN_K).to(tl.float32)
        a0, a1, a2, a3, a4, a5, a6, a7, s0, s1, s2, s3, s4, s5, s6, s7 = _tile(
            a0, a1, a2, a3, a4, a5, a6, a7, s0, s1, s2, s3, s4, s5, s6, s7, w, rk, x_ptr, res_ptr, g_ptr,
            res_out_ptr, M, K, stride_xm, stride_rm, first, BLOCK_M, NORM, HAS_RES, SILU_MUL, EVEN_K)
    _emit(out_ptr, b_ptr, add_ptr, ws_ptr, a0, s0, 0, rn, pid_k, M, N, K, eps, BLOCK_M, NORM, HAS_BIAS, ADD_OUT,
              SPLIT_K)
    if BLOCK_M > 1:
        _emit(out_ptr, b_ptr, add_ptr, ws_ptr, a1, s1, 1, rn, pid_k, M, N, K, eps, BLOCK_M, NORM, HAS_BIAS, ADD_OUT,
              SPLIT_K)
    if BLOCK_M > 2:
        _emit(out_ptr, b_ptr, add_ptr, ws_ptr, a2, s2, 2, rn, pid_k, M, N, K, eps, BLOCK_M, NORM, HAS_BIAS, ADD_OUT,
              SPLIT_K)
        _emit(out_ptr, b_ptr, add_ptr, ws_ptr, a3, s3, 3, rn, pid_k, M, N, K, eps, BLOCK_M, NORM, HAS_BIAS, ADD_OUT,
              SPLIT_K)
    if BLOCK_M > 4:
        _emit(out_ptr, b_ptr, add_ptr, ws_ptr, a4, s4, 4, rn, pid_k, M, N, K, eps, BLOCK_M, NORM, HAS_BIAS, ADD_OUT,
              SPLIT_K)
        _emit(out_ptr, b_ptr, add_ptr, ws_ptr, a5, s5, 5, rn, pid_k, M, N, K, eps, BLOCK_M, NORM, HAS_BIAS, ADD_OUT,
              SPLIT_K)
        _emit(out_ptr, b_ptr, add_ptr, ws_ptr, a6, s6, 6, rn, pid_k, M, N, K, eps, BLOCK_M, NORM, HAS_BIAS, ADD_OUT,
              SPLIT_K)
        _emit(out_ptr, b_ptr, add_ptr, ws_ptr, a7, s7, 7, rn, pid_k, M, N, K, eps, BLOCK_M, NORM, HAS_BIAS, ADD_OUT,
              SPLIT_K)
    if SPLIT_K > 1:
        _finish(out_ptr, b_ptr, add_ptr, ws_ptr, cnt_ptr, pid, rn, M, N, BLOCK_M, SPLIT_K, HAS_BIAS, ADD_OUT)
