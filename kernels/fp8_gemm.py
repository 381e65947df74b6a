"""Block-scaled FP8 GEMM (W8A8, DeepSeek-V3 / Qwen3-FP8 layout) and per-token-group activation quantization.

Weights are float8_e4m3fn with one float32 scale per 128 x 128 block (the checkpoint's
``weight_scale_inv``: dequantized weight = fp8 value * scale). Here the weight scales are kept
expanded along the output dimension, one row of scales per output row: ``w_s [N, ceil(K / G)]``.
That way a fused QKV / gate_up weight whose parts (or tensor-parallel shards) do not start on a
128-row boundary still has the exact scale for every row, and the kernel reads a vector of scales
per output tile. Activations are quantized on the fly, one scale per token per group of G = 128
input features (``a_s [M, ceil(K / G)]``, scale = amax / 448), as DeepSeek-V3's "fine-grained
quantization" (arXiv:2412.19437, section 3.3) and vLLM's ``per_token_group_quant_fp8`` do.

out[m, n] = sum_g a_s[m, g] * w_s[n, g] * sum_{k in group g} a[m, k] * w[n, k]   (float32 accumulate)
"""

from __future__ import annotations

import dataclasses

import torch

from fxrewrite.kernels import use_triton
from fxrewrite.kernels.triton_utils import launch, tl, triton

__all__ = ["FP8_DTYPE", "FP8_MAX", "GemmConfig", "per_token_group_quant_fp8", "per_token_group_quant_fp8_ref",
           "fp8_block_gemm", "fp8_block_gemm_ref", "fp8_block_gemm_triton", "fp8_linear", "swizzled_tile"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_EPS = 1e-10  # floor on a group's amax so an all-zero group gets a finite scale


def per_token_group_quant_fp8_ref(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (x_q [M, K] float8_e4m3fn, scales [M, ceil(K / group_size)] float32).

    scale = max(amax of the group, 1e-10) / 448; x_q = clamp(x / scale, -448, 448) in float32.
    The last group may be partial (K not a multiple of group_size).
    """
    m, k = x.shape
    groups = -(-k // group_size)
    pad = groups * group_size - k
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(m, groups, group_size)
    scale = xf.abs().amax(dim=-1).clamp_min(_EPS) / FP8_MAX
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).view(m, groups * group_size)[:, :k]
    return q.to(FP8_DTYPE).contiguous(), scale


def fp8_block_gemm_ref(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
                       group_size: int = 128, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Torch reference: dequantize both sides to float32 and matmul.

    a [M, K] fp8, a_s [M, G'] float32, w [N, K] fp8, w_s [N, G'] float32 with G' = ceil(K / group_size)
    -> [M, N] out_dtype.
    """
    k = a.shape[1]
    af = a.float() * a_s.repeat_interleave(group_size, dim=1)[:, :k]
    wf = w.float() * w_s.repeat_interleave(group_size, dim=1)[:, :k]
    return (af @ wf.t()).to(out_dtype)


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int = 128,
                              column_major_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`per_token_group_quant_fp8_ref`; Triton on CUDA. With column_major_scales
    the scales come with strides (1, M) (what torch's block-scaled matmul takes), same values."""
    if not use_triton(x):
        q, s = per_token_group_quant_fp8_ref(x, group_size)
        return (q, s.t().contiguous().as_strided(s.shape, (1, max(s.shape[0], 1)))) if column_major_scales else (q, s)
    x = x.contiguous()
    m, k = x.shape
    groups = -(-k // group_size)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    stride = (1, max(m, 1)) if column_major_scales else (groups, 1)
    s = torch.empty_strided((m, groups), stride, dtype=torch.float32, device=x.device)
    launch(_quant_kernel, (m, groups), x.device)(x, q, s, k, stride[0], stride[1], _EPS, FP8_MAX, GROUP=group_size)
    return q, s


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_s_m, stride_s_g, eps, fp8_max, GROUP: tl.constexpr):
    row = tl.program_id(0)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    mask = offs < K
    x = tl.load(x_ptr + row * K + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), eps) / fp8_max
    q = tl.clamp(x / scale, -fp8_max, fp8_max)
    tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_s_m + g * stride_s_g, scale)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch parameters of the Triton GEMM (BLOCK_K is the scale group, 128)."""

    block_m: int
    block_n: int
    group_m: int = 1
    """Output-tile rows swizzled together so consecutive programs share weight tiles in L2."""
    num_warps: int = 4
    num_stages: int = 3
    split_k: bool = False
    """Split K over programs when the output tiles cannot fill the GPU (decode)."""


OLD_CONFIGS = ((16, GemmConfig(16, 64, split_k=True)), (64, GemmConfig(64, 64, split_k=True)),
               (None, GemmConfig(128, 128, num_warps=8)))
"""The first tuning (2026-11-30 benchmark: 2-4x slower than bf16 from M = 128): (max M, config)."""
CONFIGS = ((16, GemmConfig(16, 64, num_stages=4, split_k=True)), (64, GemmConfig(64, 64, num_stages=4, split_k=True)),
           (None, GemmConfig(64, 128, group_m=8, num_warps=4, num_stages=4)))
"""Default (max M, config) table: for M > 64 the w8a8 block-FP8 shape of vLLM's tuned tables and
DeepGEMM (BLOCK_M 64, BLOCK_N = BLOCK_K = 128, group-M swizzle, 4-stage software pipeline)."""
ALT_CONFIGS = (GemmConfig(128, 128, group_m=8, num_warps=8, num_stages=3),
               GemmConfig(64, 128, group_m=8, num_warps=4, num_stages=3),
               GemmConfig(128, 128, group_m=8, num_warps=4, num_stages=4))
"""Other candidates the load-time tuner (fp8_dispatch.py) and the benchmark also time for M > 64."""


def config_for(m: int, table=CONFIGS) -> GemmConfig:
    return next(cfg for max_m, cfg in table if max_m is None or m <= max_m)


_TARGET_PROGRAMS = 264  # 2 per SM on an H100/H200 (132 SMs): enough tiles to keep every SM streaming


def _split_k(num_tiles: int, groups: int, m: int) -> int:
    """K splits for small-M GEMMs whose output tiles cannot fill the GPU (decode of o_proj / down_proj)."""
    if m > 64 or num_tiles >= _TARGET_PROGRAMS:
        return 1
    return max(1, min(groups, _TARGET_PROGRAMS // num_tiles))


def fp8_block_gemm_triton(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
                          group_size: int = 128, out_dtype: torch.dtype = torch.bfloat16,
                          config: GemmConfig | None = None) -> torch.Tensor:
    """Triton kernel, same contract as :func:`fp8_block_gemm_ref` (one K-step per scale group).

    a_s and w_s may be row-major or outer-dim major (what torch's scaled_mm takes); `config` defaults to
    `config_for(M)`. Small M with few output tiles splits K over programs into float32 partials.
    """
    m, k = a.shape
    n, groups = w.shape[0], a_s.shape[1]
    cfg = config or config_for(m)
    tiles_m, tiles_n = triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n)
    split = _split_k(tiles_m * tiles_n, groups, m) if cfg.split_k else 1
    out = torch.empty((split, m, n), dtype=torch.float32 if split > 1 else out_dtype, device=a.device)
    launch(_gemm_kernel, (tiles_m * tiles_n, split), a.device)(
        a, a_s, w, w_s, out, m, n, k, groups, triton.cdiv(groups, split), a_s.stride(0), a_s.stride(1),
        w_s.stride(0), w_s.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=group_size, GROUP_M=cfg.group_m, EVEN_K=k % group_size == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out[0] if split == 1 else out.sum(0).to(out_dtype)


@triton.jit
def swizzled_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid` under the group-M swizzle of Triton's matmul tutorial:
    GROUP_M row tiles sweep the column tiles together, so consecutive programs share weight tiles in L2."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit(do_not_specialize=["M"])  # the token count
def _gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, G, GROUPS_PER_SPLIT, stride_as_m, stride_as_g,
                 stride_ws_n, stride_ws_g, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    pid_m, pid_n = swizzled_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    g_start = pid_k * GROUPS_PER_SPLIT
    g_end = tl.minimum(g_start + GROUPS_PER_SPLIT, G)
    for g in range(g_start, g_end):
        k = g * BLOCK_K + rk
        a_ptrs = a_ptr + rm[:, None] * K + k[None, :]
        w_ptrs = w_ptr + rn[None, :] * K + k[:, None]
        if EVEN_K:  # whole groups (every Qwen3 / DeepSeek shape): no mask along contiguous K, loads vectorize
            a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = k < K
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        a_s = tl.load(as_ptr + rm * stride_as_m + g * stride_as_g, mask=m_mask, other=0.0)
        w_s = tl.load(ws_ptr + rn * stride_ws_n + g * stride_ws_g, mask=n_mask, other=0.0)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
    out = out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_block_gemm(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
                   group_size: int = 128, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Block-scaled FP8 GEMM (contract of :func:`fp8_block_gemm_ref`); Triton on CUDA.

    Raises ValueError when shapes disagree.
    """
    m, k = a.shape
    groups = -(-k // group_size)
    if w.shape[1] != k or a_s.shape != (m, groups) or w_s.shape != (w.shape[0], groups):
        raise ValueError(f"fp8_block_gemm: a {tuple(a.shape)}, a_s {tuple(a_s.shape)}, w {tuple(w.shape)}, "
                         f"w_s {tuple(w_s.shape)} do not fit group_size={group_size} "
                         f"(expected a_s [{m}, {groups}], w_s [N, {groups}])")
    if use_triton(a):
        return fp8_block_gemm_triton(a, a_s, w, w_s, group_size, out_dtype)
    return fp8_block_gemm_ref(a, a_s, w, w_s, group_size, out_dtype)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) -> [..., N] in x's dtype: dynamic per-token-group quantization of x,
    then :func:`fp8_block_gemm` with the FP8 weight w [N, K] and its row-expanded scales w_s [N, G']."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    q, s = per_token_group_quant_fp8(x2, group_size)
    return fp8_block_gemm(q, s, w, w_s, group_size, x.dtype).reshape(*lead, w.shape[0])
