"""One-token FP8 gate_up GEMV with SiLU-and-mul in its epilogue: batch-1 decode's gated MLP input without the
SiLU-and-mul kernel between gate_up_proj and down_proj.

x [1, K] float, w [2I, K] float8_e4m3fn (the gate rows then the up rows, as `MergedColumnParallelLinear` holds them on
each rank), w_s [2I, ceil(K/128)] float32 -> [1, I] in x's dtype: silu(g) * u with g = x @ gate^T and u = x @ up^T,
each rounded to x's dtype first, so the result is what the unfused pair computes (the pipelined GEMV writes
gate_up in x's dtype, `fxrewrite.kernels.activation`'s kernel reads it back in float32).

The loop is `fxrewrite.kernels.fp8_gemv_pipelined`'s per-channel / shared-scale one with two row streams: program
p owns gate rows [p B, (p + 1) B) and the up rows I + the same, B = BLOCK_N / 2 (the config's rows per program
split between them, so a program streams as many bytes as the ungated GEMV's), each with its float32 accumulator.
Shared scales (block-scaled checkpoints whose 128-row runs cover a half tile; the caller's ``scale_rows`` promise)
scale x once per stream and step; per-channel scales multiply the reduced sums. The per-element scale form is not
here: such layers keep the unfused pair.

Reference: `fp8_gemv_gated_ref`.
"""

from __future__ import annotations

import torch

from fxrewrite.kernels.activation import silu_and_mul_ref
from fxrewrite.kernels.fp8_gemv import fp8_weight_only_gemv_ref
from fxrewrite.kernels.pdl import fp8_gemv_pdl
from fxrewrite.kernels.triton_utils import launch, tl, triton

__all__ = ["fp8_gemv_gated_ref", "fp8_gemv_gated_triton", "supports"]


def fp8_gemv_gated_ref(x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    """SiLU-and-mul of the weight-only product (`fp8_weight_only_gemv_ref`, rounded to x's dtype) in float32, as
    `fxrewrite.kernels.activation`'s kernel computes it, rounded once to x's dtype: [1, I]."""
    return silu_and_mul_ref(fp8_weight_only_gemv_ref(x, w, w_s, 128, x.dtype).float()).to(x.dtype)


def supports(config: tuple[int, ...], inter: int, per_channel: bool, scale_rows: int) -> bool:
    """Whether the kernel runs `config` (a `PIPELINED_CONFIGS` entry) for I = `inter` on these scales: per-channel,
    or equal in aligned runs of `scale_rows` rows that cover each half tile and start the up rows (I a multiple)."""
    half = config[0] // 2
    return half >= 1 and (per_channel or (scale_rows % half == 0 and inter % scale_rows == 0))


def fp8_gemv_gated_triton(x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, config: tuple[int, ...],
                          per_channel: bool = True, scale_rows: int = 1) -> torch.Tensor:
    """x [1, K] bf16 / fp16 / fp32 with unit column stride, w [2I, K] float8_e4m3fn contiguous, w_s [2I, ceil(K/128)]
    float32 in any strides -> [1, I] in x's dtype. config: (block_n, block_k, num_stages, num_warps) as the pipelined
    GEMV's (block_n rows a program, half gate, half up). ValueError for another layout, an odd row count, or scales
    `supports` refuses."""
    n2, k = w.shape
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1 or not w.is_contiguous() or x.shape[1] != k or n2 % 2:
        raise ValueError(f"fp8_gemv_gated: needs x [1, K] with unit column stride and a contiguous weight [2I, K]; "
                         f"got x {tuple(x.shape)} strides {x.stride()}, w {tuple(w.shape)}")
    if tuple(w_s.shape) != (n2, -(-k // 128)) or config[1] % 128 or not supports(config, n2 // 2, per_channel, scale_rows):
        raise ValueError(f"fp8_gemv_gated: scales {tuple(w_s.shape)} (per_channel={per_channel}, scale_rows="
                         f"{scale_rows}) with config {config}; expected [{n2}, {-(-k // 128)}], per-channel or "
                         f"shared by runs of {config[0] // 2} rows, block_k a multiple of 128")
    block_n, block_k, stages, warps = config
    half = block_n // 2
    inter = n2 // 2
    out = torch.empty((1, inter), dtype=x.dtype, device=x.device)
    pdl, trigger = fp8_gemv_pdl(x.device)
    launch(_gated_gemv_kernel, (triton.cdiv(inter, half),), x.device, pdl)(
        x, w, w_s, out, inter, k, w_s.stride(0), w_s.stride(1), BLOCK_N=half, BLOCK_K=block_k, NUM_STAGES=stages,
        PER_CHANNEL=per_channel, PDL=pdl, TRIGGER=trigger, num_warps=warps)
    return out


@triton.jit
def _scaled_x(x_ptr, ws_row_ptr, stride_ws_g, k0, K, BLOCK_K: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """x's step tile in float32, times the step's group scales of one scale row unless per-channel."""
    k = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    if not PER_CHANNEL:
        GROUPS: tl.constexpr = BLOCK_K // 128
        g = k0 // 128 + tl.arange(0, GROUPS)
        s = tl.load(ws_row_ptr + g * stride_ws_g, mask=g * 128 < K, other=0.0)
        x = tl.reshape(tl.reshape(x, (GROUPS, 128)) * s[:, None], (BLOCK_K,))
    return x


@triton.jit
def _gated_gemv_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, I, K, stride_ws_n, stride_ws_g, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PER_CHANNEL: tl.constexpr,
                       PDL: tl.constexpr, TRIGGER: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_row = tl.minimum(rn, I - 1)  # a partial last tile re-reads row I - 1; its outputs are not stored
    up_row = gate_row + I
    if PDL:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    gate_rows = w_ptr + gate_row.to(tl.int64)[:, None] * K
    up_rows = w_ptr + up_row.to(tl.int64)[:, None] * K
    first = tl.program_id(0) * BLOCK_N  # the tile's first gate row; I + first its first up row
    rk = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + rk
        wg = tl.load(gate_rows + k[None, :], mask=(k < K)[None, :], other=0.0).to(tl.float32)
        wu = tl.load(up_rows + k[None, :], mask=(k < K)[None, :], other=0.0).to(tl.float32)
        xg = _scaled_x(x_ptr, ws_ptr + first.to(tl.int64) * stride_ws_n, stride_ws_g, k0, K, BLOCK_K, PER_CHANNEL)
        xu = _scaled_x(x_ptr, ws_ptr + (first + I).to(tl.int64) * stride_ws_n, stride_ws_g, k0, K, BLOCK_K,
                       PER_CHANNEL)
        acc_g += wg * xg[None, :]
        acc_u += wu * xu[None, :]
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if PER_CHANNEL:
        g = g * tl.load(ws_ptr + gate_row * stride_ws_n)
        u = u * tl.load(ws_ptr + up_row * stride_ws_n)
    # rounded as the pipelined GEMV writes gate_up, then SiLU-and-mul as its kernel computes it
    g = g.to(out_ptr.dtype.element_ty).to(tl.float32)
    u = u.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + rn, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=rn < I)
