"""RMSNorm and SiLU-and-mul with the FP8 activation quantization of the next GEMM fused in: the producing
kernel writes float8_e4m3fn activations and their dynamic scales directly, so the FP8 GEMM (row-wise
scaled matmul, per-token scales; or the block-scaled GEMMs, per-token-group scales of 128 columns) reads
FP8, and neither the bf16 intermediate nor the separate quantization kernel exists (vLLM fuses the same
pairs: ``rms_norm_dynamic_per_token_quant``, ``silu_and_mul_per_token_group_quant``).

Values are those of the unfused kernels, roundings included: the normalized / activated row is rounded to
the input dtype as the RMSNorm (``weight * x_hat.to(dtype)``, transformers' LlamaRMSNorm) and
SiLU-and-mul kernels store it, then quantized as `fxrewrite.kernels.fp8_rowwise.per_token_quant_fp8_ref`
/ `fxrewrite.kernels.fp8_gemm.per_token_group_quant_fp8_ref`: scale = max(amax, 1e-10) / 448, q = clamp(
v / scale, +-448). One program per token row. A row of up to ROW_MAX columns is read once and held in
registers (`_quant_row_kernel`); a longer one loops over chunks of CHUNK_G groups of 128 columns: RMSNorm
sums squares first (writing the new residual), then quantizes per group in one more pass, or per token in
two (amax, then quantize); the re-reads of one row come from L1 / L2.
References: `rms_norm_quant_fp8_ref`, `silu_and_mul_quant_fp8_ref`.
"""

from __future__ import annotations

import functools

import torch

from fxrewrite.kernels.activation import silu_and_mul_ref
from fxrewrite.kernels.fp8_gemm import _EPS, FP8_DTYPE, FP8_MAX, per_token_group_quant_fp8_ref
from fxrewrite.kernels.fp8_rowwise import per_token_quant_fp8_ref
from fxrewrite.kernels.pdl import gdc_prologue, pdl_enabled
from fxrewrite.kernels.rms_norm import rms_norm_ref
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["rms_norm_quant_fp8", "rms_norm_quant_fp8_ref", "silu_and_mul_quant_fp8", "silu_and_mul_quant_fp8_ref"]

_GROUP = 128
CHUNK_G = 8
"""Groups of 128 columns per loop step (1024 columns: 4-8 values per thread at 4 warps)."""
ROW_MAX = 16384
"""Rows up to this many columns (K rounded up to a power of two of groups) take the one-pass kernel: the
three-pass loop cost 6.3 us a call at 200 tokens of Qwen3-4B on an H200, 2.6x the unfused RMSNorm; one
pass 4.4 (benchmarks/results/2026-12-02-qwen3-4b-native-fp8-b200-decode-profile{,-one-pass}-sixteenth.json)."""


def _quant_ref(h: torch.Tensor, group_size: int | None):
    if group_size is None:
        return per_token_quant_fp8_ref(h)
    return per_token_group_quant_fp8_ref(h, group_size)


def rms_norm_quant_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                           group_size: int | None = None):
    """Torch reference: `rms_norm_ref` (x [M, K], weight [K], residual [M, K] or None), then the per-token
    (group_size None: scales [M, 1]) or per-token-group (group_size 128: scales [M, ceil(K/128)]) FP8
    quantization. Returns (q [M, K] float8_e4m3fn, scales float32, x + residual or None)."""
    out = rms_norm_ref(x, weight, eps, residual)
    h, new_res = out if residual is not None else (out, None)
    return (*_quant_ref(h, group_size), new_res)


def silu_and_mul_quant_fp8_ref(x: torch.Tensor, group_size: int | None = None):
    """Torch reference: silu(x[:, :d]) * x[:, d:] (x [M, 2d]) in x's dtype, then the FP8 quantization as in
    `rms_norm_quant_fp8_ref`. Returns (q [M, d], scales)."""
    return _quant_ref(silu_and_mul_ref(x), group_size)


def _outputs(m: int, k: int, group_size: int | None, device):
    if group_size not in (None, _GROUP):
        raise ValueError(f"FP8 activation groups of {group_size} columns; supported: None (per token) or {_GROUP}")
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=device)
    if group_size is None:  # [M, 1] contiguous: the row-wise scaled matmul's scale_a
        return q, torch.empty((m, 1), dtype=torch.float32, device=device)
    groups = -(-k // _GROUP)
    s = torch.empty_strided((m, groups), (1, max(m, 1)), dtype=torch.float32, device=device)  # outer-dim major
    return q, s


def rms_norm_quant_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                       group_size: int | None = None):
    """The fused Triton kernel; contract of `rms_norm_quant_fp8_ref` (x and residual with unit column
    stride, one float dtype); scales come with strides (1, M) (what the FP8 GEMMs read). ValueError for
    other group sizes or shapes."""
    m, k = x.shape
    if weight.shape != (k,) or (residual is not None and residual.shape != x.shape) or x.stride(1) != 1:
        raise ValueError(f"rms_norm_quant_fp8: x {tuple(x.shape)} (unit column stride), weight {tuple(weight.shape)}"
                         f" and residual {None if residual is None else tuple(residual.shape)} do not fit")
    q, s = _outputs(m, k, group_size, x.device)
    weight = weight.contiguous()  # the kernel reads it at unit stride
    res = residual.contiguous() if residual is not None else x
    new_res = torch.empty_like(x) if residual is not None else x
    if m:
        _launch(m, k, group_size, True, residual is not None, x.device)(
            x, res, weight, new_res, q, s, k, x.stride(0), res.stride(0), s.stride(0), s.stride(1), float(eps),
            _EPS, FP8_MAX)
    return q, s, (new_res if residual is not None else None)


def silu_and_mul_quant_fp8(x: torch.Tensor, group_size: int | None = None):
    """The fused Triton kernel; contract of `silu_and_mul_quant_fp8_ref` (x [M, 2d] with unit column stride);
    scales with strides (1, M)."""
    m, two_d = x.shape
    if two_d % 2 or x.stride(1) != 1:
        raise ValueError(f"silu_and_mul_quant_fp8: x {tuple(x.shape)} needs an even last dim and unit column stride")
    k = two_d // 2
    q, s = _outputs(m, k, group_size, x.device)
    if m:
        _launch(m, k, group_size, False, False, x.device)(
            x, x, x, x, q, s, k, x.stride(0), x.stride(0), s.stride(0), s.stride(1), 0.0, _EPS, FP8_MAX)
    return q, s


def _launch(m: int, k: int, group_size: int | None, norm: bool, has_res: bool, device):
    """The kernel for [m, k] rows, its constants bound: one pass when a row fits ROW_MAX, else the chunk loop."""
    groups = next_power_of_2(-(-k // _GROUP))
    flags = {"NORM": norm, "HAS_RES": has_res, "GROUPED": group_size is not None, "GROUP": _GROUP}
    pdl = pdl_enabled(device)
    if groups * _GROUP <= ROW_MAX:
        warps = 4 if groups * _GROUP <= 4096 else 8
        return functools.partial(launch(_quant_row_kernel, (m,), device, pdl), CHUNK_G=groups, num_warps=warps,
                                 PDL=pdl, **flags)
    return functools.partial(launch(_quant_kernel, (m,), device, pdl), CHUNK_G=CHUNK_G, num_warps=4, PDL=pdl, **flags)


@triton.jit
def _value(x_ptr, r_ptr, g_ptr, res_out_ptr, row, offs, mask, K, stride_xm, stride_rm, rstd,
           WRITE_RES: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """The activation at `offs` of token `row` in float32, rounded as the unfused kernel stores it.
    NORM with WRITE_RES (the first pass): x (+ residual) itself, for the sum of squares."""
    if NORM:
        xv = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + row * stride_rm + offs, mask=mask, other=0.0)
            xv = (xv.to(tl.float32) + r.to(tl.float32)).to(xv.dtype)  # one rounding, as a bf16 add
            if WRITE_RES:
                tl.store(res_out_ptr + row * K + offs, xv, mask=mask)
        v = xv.to(tl.float32)
        if not WRITE_RES:
            v = _normed(v, rstd, tl.load(g_ptr + offs, mask=mask, other=0.0), xv.dtype)
    else:
        gate = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_xm + K + offs, mask=mask, other=0.0).to(tl.float32)
        gf = gate.to(tl.float32)
        v = (gf * tl.sigmoid(gf) * up).to(gate.dtype).to(tl.float32)
    return v


@triton.jit
def _normed(v, rstd, w, DTYPE: tl.constexpr):
    """RMSNorm's output in float32 from v (x + residual, float32 of DTYPE values) and the weight w loaded at its
    columns: weight * (v * rstd).to(DTYPE), rounded to DTYPE, as the unfused kernel stores it."""
    h = (v * rstd).to(DTYPE)
    return (h.to(tl.float32) * w.to(tl.float32)).to(DTYPE).to(tl.float32)


@triton.jit
def _quant_row_kernel(x_ptr, r_ptr, g_ptr, res_out_ptr, q_ptr, s_ptr, K, stride_xm, stride_rm, stride_sm, stride_sg,
                      eps, amax_floor, fp8_max, NORM: tl.constexpr, HAS_RES: tl.constexpr, GROUPED: tl.constexpr,
                      CHUNK_G: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr):
    """`_quant_kernel` for a row that fits one chunk (CHUNK_G * GROUP >= K): read once, kept in registers."""
    row = tl.program_id(0).to(tl.int64)
    rg = tl.arange(0, CHUNK_G)
    offs = rg[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [CHUNK_G, 128]
    mask = offs < K
    if NORM:  # the (read-only) weight loads first, under PDL before the wait for the previous kernel
        w = tl.load(g_ptr + offs, mask=mask, other=0.0)
    gdc_prologue(PDL)
    v = _value(x_ptr, r_ptr, g_ptr, res_out_ptr, row, offs, mask, K, stride_xm, stride_rm, 0.0, NORM, NORM, HAS_RES)
    if NORM:  # v: x (+ residual), the new residual written; masked columns are 0
        rstd = tl.rsqrt(tl.sum(tl.sum(v * v, axis=1), axis=0) / K + eps)
        v = _normed(v, rstd, w, x_ptr.dtype.element_ty)
    if GROUPED:
        scale = tl.maximum(tl.max(tl.abs(v), axis=1), amax_floor) / fp8_max  # [CHUNK_G]
        q = tl.clamp(v / scale[:, None], -fp8_max, fp8_max)
        tl.store(s_ptr + row * stride_sm + rg * stride_sg, scale, mask=rg * GROUP < K)
    else:
        scale = tl.maximum(tl.max(tl.max(tl.abs(v), axis=1), axis=0), amax_floor) / fp8_max
        q = tl.clamp(v / scale, -fp8_max, fp8_max)
        tl.store(s_ptr + row * stride_sm, scale)
    tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quant_kernel(x_ptr, r_ptr, g_ptr, res_out_ptr, q_ptr, s_ptr, K, stride_xm, stride_rm, stride_sm, stride_sg, eps,
                  amax_floor, fp8_max, NORM: tl.constexpr, HAS_RES: tl.constexpr, GROUPED: tl.constexpr,
                  CHUNK_G: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr):
    gdc_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    rg = tl.arange(0, CHUNK_G)
    col = rg[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [CHUNK_G, 128]
    rstd = 0.0
    if NORM:  # pass 1: sum of squares of x (+ residual), the new residual written
        ss = tl.zeros((CHUNK_G, GROUP), dtype=tl.float32)
        for k0 in range(0, K, CHUNK_G * GROUP):
            offs = k0 + col
            v = _value(x_ptr, r_ptr, g_ptr, res_out_ptr, row, offs, offs < K, K, stride_xm, stride_rm, 0.0, True,
                       NORM, HAS_RES)
            ss += v * v
        rstd = tl.rsqrt(tl.sum(tl.sum(ss, axis=1), axis=0) / K + eps)
    if GROUPED:  # one pass: every group's amax and values together
        for k0 in range(0, K, CHUNK_G * GROUP):
            offs = k0 + col
            mask = offs < K
            v = _value(x_ptr, r_ptr, g_ptr, res_out_ptr, row, offs, mask, K, stride_xm, stride_rm, rstd, False,
                       NORM, HAS_RES)
            scale = tl.maximum(tl.max(tl.abs(v), axis=1), amax_floor) / fp8_max  # [CHUNK_G]
            q = tl.clamp(v / scale[:, None], -fp8_max, fp8_max)
            tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
            gs = k0 // GROUP + rg
            tl.store(s_ptr + row * stride_sm + gs * stride_sg, scale, mask=gs * GROUP < K)
    else:  # per token: the row's amax, then quantize
        amax = tl.zeros((CHUNK_G, GROUP), dtype=tl.float32)
        for k0 in range(0, K, CHUNK_G * GROUP):
            offs = k0 + col
            v = _value(x_ptr, r_ptr, g_ptr, res_out_ptr, row, offs, offs < K, K, stride_xm, stride_rm, rstd, False,
                       NORM, HAS_RES)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.maximum(tl.max(tl.max(amax, axis=1), axis=0), amax_floor) / fp8_max
        for k0 in range(0, K, CHUNK_G * GROUP):
            offs = k0 + col
            mask = offs < K
            v = _value(x_ptr, r_ptr, g_ptr, res_out_ptr, row, offs, mask, K, stride_xm, stride_rm, rstd, False,
                       NORM, HAS_RES)
            tl.store(q_ptr + row * K + offs, tl.clamp(v / scale, -fp8_max, fp8_max).to(q_ptr.dtype.element_ty),
                     mask=mask)
        tl.store(s_ptr + row * stride_sm, scale)
