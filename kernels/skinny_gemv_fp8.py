"""The skinny GEMV (`fxrewrite.kernels.skinny_gemv`) on float8_e4m3fn weights, dequantized in registers:
block-scaled (one float32 scale per row and 128-column group, w_scale [N, ceil(K/128)], the layout the FP8
layers keep: the checkpoint's 128 x 128 blocks expanded along N) or per-channel (one scale per row, column
0 of the same [N, G] tensor). Weight-only: the activations stay in their float dtype, no quantization
kernel runs, and the same prologues fuse in (RMSNorm with the residual add, SiLU-and-mul, bias), as does the
``out_residual`` epilogue (a decoder layer's closing residual add, rounded as torch's two ops round).

Same tiling idea as the bf16 kernel, with the weight tile viewed as [BLOCK_N, BLOCK_G, 128] (BLOCK_G whole
scale groups per loop step, contiguous along K: 16-byte loads of 16 FP8 values). Block-scaled: the
[BLOCK_N, BLOCK_G] scales of the step multiply the tile once (shared by every token) before the
elementwise multiply-adds into the float32 [BLOCK_N, BLOCK_G, 128] accumulators, reduced once after the
loop. Per-channel: the row scale multiplies the reduced sum (sum_k s_n w[n,k] x[k] = s_n sum_k w[n,k] x[k]),
so the loop is the bf16 kernel's. The token input is loaded as [BLOCK_G, 128] by the bf16 kernel's
`_token` prologue (shape-agnostic), so norm and SiLU-and-mul are computed exactly as there.

Reference `skinny_gemv_fp8_ref`: the prologue as the unfused ops compute it (in x's dtype), then the
product with the dequantized weight (fp8 * scale) in float32, rounded to x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxrewrite.kernels.activation import silu_and_mul_ref
from fxrewrite.kernels.rms_norm import rms_norm_ref
from fxrewrite.kernels.pdl import fp8_gemv_pdl
from fxrewrite.kernels.skinny_gemv import _check, _load, _token, add_out_residual, configs_for
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["GROUP", "dequantize", "skinny_gemv_fp8_ref", "skinny_gemv_fp8_triton"]

GROUP = 128
"""Columns per weight scale (the FP8 checkpoints' block width; the FP8 layers' only GEMV-eligible size)."""


def dequantize(w: torch.Tensor, w_scale: torch.Tensor, per_channel: bool = False) -> torch.Tensor:
    """w [N, K] fp8, w_scale [N, ceil(K/128)] float32 -> float32 [N, K] = w * scale of its (row, group)
    (per_channel: column 0 of w_scale for every group)."""
    k = w.shape[1]
    s = w_scale[:, :1] if per_channel else w_scale.repeat_interleave(GROUP, dim=1)[:, :k]
    return w.float() * s.float()


def _check_fp8(w: torch.Tensor, w_scale: torch.Tensor) -> None:
    groups = -(-w.shape[1] // GROUP)
    if w.dtype != torch.float8_e4m3fn or w_scale.dim() != 2 or tuple(w_scale.shape) != (w.shape[0], groups):
        raise ValueError(f"skinny_gemv_fp8: needs a float8_e4m3fn weight [N, K] and float32 scales "
                         f"[N, ceil(K/{GROUP})] = [{w.shape[0]}, {groups}]; got {w.dtype} {tuple(w.shape)} and "
                         f"{tuple(w_scale.shape)}")


def skinny_gemv_fp8_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                        *, per_channel: bool = False, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                        residual: torch.Tensor | None = None, silu_mul: bool = False,
                        out_residual: torch.Tensor | None = None):
    """Torch reference. x [M, K] (or [M, 2K] with silu_mul) bf16 / fp16 / fp32, w [N, K] fp8, w_scale
    [N, ceil(K/128)] float32, bias [N] in x's dtype or None. Prologues, the out_residual epilogue and the return
    value as `fxrewrite.kernels.skinny_gemv.skinny_gemv_ref`. ValueError on shapes or dtypes that do not fit."""
    _check(x, w, norm_weight, residual, silu_mul, out_residual)
    _check_fp8(w, w_scale)
    new_res = None
    if silu_mul:
        h = silu_and_mul_ref(x)
    elif norm_weight is not None:
        normed = rms_norm_ref(x, norm_weight, eps, residual)
        h, new_res = (normed[0], normed[1]) if residual is not None else (normed, None)
    else:
        h = x
    out = F.linear(h.float(), dequantize(w, w_scale, per_channel), None if bias is None else bias.float()).to(x.dtype)
    if out_residual is not None:
        out = out_residual + out
    return (out, new_res) if residual is not None else out


def skinny_gemv_fp8_triton(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                           bias: torch.Tensor | None = None, *, per_channel: bool = False,
                           norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                           residual: torch.Tensor | None = None, silu_mul: bool = False,
                           out_residual: torch.Tensor | None = None, config: tuple[int, int, int] | None = None):
    """The Triton kernel; contract of `skinny_gemv_fp8_ref` (M <= GEMV_MAX_M, else ValueError), w_scale in
    any strides. config: (block_n, block_g, num_warps), BLOCK_G scale groups of 128 columns per loop step;
    default the first of `configs_for(M, fmt="fp8")`."""
    k = _check(x, w, norm_weight, residual, silu_mul, out_residual)
    _check_fp8(w, w_scale)
    m, n = x.shape[0], w.shape[0]
    fmt = "fp8-channel" if per_channel else "fp8"
    block_n, block_g, num_warps = config or configs_for(m, fmt=fmt)[0]
    configs_for(m, fmt=fmt)  # range check
    if x.stride(1) != 1 or not w.is_contiguous():
        raise ValueError(f"skinny_gemv_fp8: needs x with unit column stride and a contiguous weight; got strides "
                         f"{x.stride()} and {w.stride()}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else out
    res_in = residual if residual is not None else x
    if res_in.stride(1) != 1:
        res_in = res_in.contiguous()
    if out_residual is not None and not out_residual.is_contiguous():
        out_residual = out_residual.contiguous()
    block_g = max(1, min(block_g, next_power_of_2(-(-k // GROUP))))
    launch(_skinny_gemv_fp8_kernel, (triton.cdiv(n, block_n),), x.device)(
        x, res_in, norm_weight if norm_weight is not None else x, w, w_scale, bias if bias is not None else x, out,
        res_out, out_residual if out_residual is not None else out, m, n, k, w_scale.shape[1], x.stride(0),
        res_in.stride(0), w_scale.stride(0), w_scale.stride(1),
        float(eps), BLOCK_M=next_power_of_2(m), BLOCK_N=block_n, BLOCK_G=block_g, GROUP_K=GROUP,
        NORM=norm_weight is not None, HAS_RES=residual is not None, SILU_MUL=silu_mul, HAS_BIAS=bias is not None,
        EVEN_K=k % (block_g * GROUP) == 0, PER_CHANNEL=per_channel, ADD_OUT=out_residual is not None,
        TRIGGER=fp8_gemv_pdl(x.device)[1],
        num_warps=num_warps,
    )
    return (out, res_out) if residual is not None else out


@triton.jit
def _fma3(acc, ss, w, i, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, M, K, stride_xm, stride_rm, write_res,
          NORM: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr):
    """Token i: acc [BLOCK_N, BLOCK_G, 128] += w * x_i; ss [BLOCK_G, 128] += x_i^2 (norm)."""
    x, sq = _token(x_ptr, res_ptr, g_ptr, res_out_ptr, i, rk, M, K, stride_xm, stride_rm, write_res,
                   NORM, HAS_RES, SILU_MUL, EVEN_K)
    if NORM:
        ss = ss + sq
    return acc + w * x[None, :, :], ss


@triton.jit
def _store3(out_ptr, b_ptr, s_ptr, add_ptr, acc, ss, i, rn, M, N, K, stride_sn, eps, NORM: tl.constexpr,
            HAS_BIAS: tl.constexpr, PER_CHANNEL: tl.constexpr, ADD_OUT: tl.constexpr):
    out = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BLOCK_N]: the one reduction over K
    if PER_CHANNEL:
        out = out * tl.load(s_ptr + tl.minimum(rn, N - 1) * stride_sn)
    if NORM:
        out = out * tl.rsqrt(tl.sum(tl.sum(ss, axis=1), axis=0) / K + eps)
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    row_ok = tl.full((1,), i, tl.int32) < M
    mask = (rn < N) & row_ok
    tl.store(out_ptr + i * N + rn, add_out_residual(out, add_ptr, i * N + rn, mask, out_ptr.dtype.element_ty, ADD_OUT),
             mask=mask)


@triton.jit
def _skinny_gemv_fp8_kernel(x_ptr, res_ptr, g_ptr, w_ptr, s_ptr, b_ptr, out_ptr, res_out_ptr, add_ptr, M, N, K, G,
                            stride_xm,
                            stride_rm, stride_sn, stride_sg, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_G: tl.constexpr, GROUP_K: tl.constexpr, NORM: tl.constexpr,
                            HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr,
                            EVEN_K: tl.constexpr, PER_CHANNEL: tl.constexpr, ADD_OUT: tl.constexpr,
                            TRIGGER: tl.constexpr):
    if TRIGGER:  # launched plainly; the next PDL kernel may start during this one's last wave (kernels/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_c = tl.minimum(rn, N - 1)  # a partial last tile re-reads row N - 1
    w_rows = w_ptr + rn_c.to(tl.int64)[:, None, None] * K
    rg0 = tl.arange(0, BLOCK_G)
    rk0 = rg0[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]  # [BLOCK_G, 128]
    first = pid == 0  # the programs of the first tile write the new residual
    a0 = tl.zeros((BLOCK_N, BLOCK_G, GROUP_K), dtype=tl.float32)
    a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
    s0 = tl.zeros((BLOCK_G, GROUP_K), dtype=tl.float32)
    s1, s2, s3, s4, s5, s6, s7 = s0, s0, s0, s0, s0, s0, s0
    for k0 in range(0, K, BLOCK_G * GROUP_K):
        rk = k0 + rk0
        w = _load(w_rows + rk[None, :, :], (rk < K)[None, :, :], EVEN_K).to(tl.float32)
        if not PER_CHANNEL:  # the step's [BLOCK_N, BLOCK_G] group scales, applied once for all tokens
            gs = k0 // GROUP_K + rg0
            sc = tl.load(s_ptr + rn_c[:, None] * stride_sn + gs[None, :] * stride_sg, mask=(gs < G)[None, :],
                         other=0.0)
            w = w * sc[:, :, None]
        a0, s0 = _fma3(a0, s0, w, 0, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, M, K, stride_xm, stride_rm, first,
                       NORM, HAS_RES, SILU_MUL, EVEN_K)
        if BLOCK_M > 1:
            a1, s1 = _fma3(a1, s1, w, 1, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, M, K, stride_xm, stride_rm, first,
                           NORM, HAS_RES, SILU_MUL, EVEN_K)
        if BLOCK_M > 2:
            a2, s2 = _fma3(a2, s2, w, 2, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, M, K, stride_xm, stride_rm, first,
                           NORM, HAS_RES, SILU_MUL, EVEN_K)
            a3, s3 = _fma3(a3, s3, w, 3, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, M, K, stride_xm, stride_rm, first,
                           NORM, HAS_RES, SILU_MUL, EVEN_K)
        if BLOCK_M > 4:
            a4, s4 = _fma3(a4, s4, w, 4, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, M, K, stride_xm, stride_rm, first,
                           NORM, HAS_RES, SILU_MUL, EVEN_K)
            a5, s5 = _fma3(a5, s5, w, 5, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, M, K, stride_xm, stride_rm, first,
                           NORM, HAS_RES, SILU_MUL, EVEN_K)
            a6, s6 = _fma3(a6, s6, w, 6, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, M, K, stride_xm, stride_rm, first,
                           NORM, HAS_RES, SILU_MUL, EVEN_K)
            a7, s7 = _fma3(a7, s7, w, 7, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, M, K, stride_xm, stride_rm, first,
                           NORM, HAS_RES, SILU_MUL, EVEN_K)
    _store_rows(out_ptr, b_ptr, s_ptr, add_ptr, a0, a1, a2, a3, a4, a5, a6, a7, s0, s1, s2, s3, s4, s5, s6, s7, rn, M,
                N, K, stride_sn, eps, BLOCK_M, NORM, HAS_BIAS, PER_CHANNEL, ADD_OUT)


@triton.jit
def _store_rows(out_ptr, b_ptr, s_ptr, add_ptr, a0, a1, a2, a3, a4, a5, a6, a7, s0, s1, s2, s3, s4, s5, s6, s7, rn, M,
                N, K, stride_sn, eps, BLOCK_M: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                PER_CHANNEL: tl.constexpr, ADD_OUT: tl.constexpr):
    """`_store3` of each of the BLOCK_M tokens' accumulators."""
    _store3(out_ptr, b_ptr, s_ptr, add_ptr, a0, s0, 0, rn, M, N, K, stride_sn, eps, NORM, HAS_BIAS, PER_CHANNEL,
            ADD_OUT)
    if BLOCK_M > 1:
        _store3(out_ptr, b_ptr, s_ptr, add_ptr, a1, s1, 1, rn, M, N, K, stride_sn, eps, NORM, HAS_BIAS, PER_CHANNEL,
                ADD_OUT)
    if BLOCK_M > 2:
        _store3(out_ptr, b_ptr, s_ptr, add_ptr, a2, s2, 2, rn, M, N, K, stride_sn, eps, NORM, HAS_BIAS, PER_CHANNEL,
                ADD_OUT)
        _store3(out_ptr, b_ptr, s_ptr, add_ptr, a3, s3, 3, rn, M, N, K, stride_sn, eps, NORM, HAS_BIAS, PER_CHANNEL,
                ADD_OUT)
    if BLOCK_M > 4:
        _store3(out_ptr, b_ptr, s_ptr, add_ptr, a4, s4, 4, rn, M, N, K, stride_sn, eps, NORM, HAS_BIAS, PER_CHANNEL,
                ADD_OUT)
        _store3(out_ptr, b_ptr, s_ptr, add_ptr, a5, s5, 5, rn, M, N, K, stride_sn, eps, NORM, HAS_BIAS, PER_CHANNEL,
                ADD_OUT)
        _store3(out_ptr, b_ptr, s_ptr, add_ptr, a6, s6, 6, rn, M, N, K, stride_sn, eps, NORM, HAS_BIAS, PER_CHANNEL,
                ADD_OUT)
        _store3(out_ptr, b_ptr, s_ptr, add_ptr, a7, s7, 7, rn, M, N, K, stride_sn, eps, NORM, HAS_BIAS, PER_CHANNEL,
                ADD_OUT)
