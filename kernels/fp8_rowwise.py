"""Row-wise scaled FP8 GEMM for per-output-channel weights (``quantization="fp8"`` on a bf16 checkpoint).

Weights carry one float32 scale per output row (dequantized w[n, :] = fp8 w[n, :] * w_scale[n]) and
activations one scale per token, computed on the fly (scale = max(amax of the row, 1e-10) / 448):

    out[m, n] = a_scale[m] * w_scale[n] * sum_k a[m, k] * w[n, k]   (float32 accumulate)

That is the "row-wise" scaling of ``torch._scaled_mm`` (scale_a [M, 1], scale_b [1, N], float32),
which torch runs through its CUTLASS sm90 kernel (``f8f8bf16_rowwise`` in
``aten/src/ATen/native/cuda/RowwiseScaledMM.cu``), and of `fp8_rowwise_gemm_triton`: one float32
accumulator over all of K (no per-group rescaling, unlike the block-scaled GEMM), both scales applied
once in the epilogue. vLLM's online FP8 uses per-tensor weight scales; per-channel is at least as
accurate. References: `per_token_quant_fp8_ref`, `fp8_rowwise_gemm_ref`.
"""

from __future__ import annotations

import torch

from fxrewrite.kernels import use_triton
from fxrewrite.kernels.fp8_gemm import _EPS, FP8_DTYPE, FP8_MAX, GemmConfig, swizzled_tile
from fxrewrite.kernels.pdl import gdc_prologue, pdl_enabled
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["per_token_quant_fp8", "per_token_quant_fp8_ref", "fp8_rowwise_gemm_ref", "fp8_scaled_mm_rowwise",
           "fp8_rowwise_gemm_triton", "ROWWISE_CONFIGS", "ROWWISE_MAX_M", "channel_scales"]

_BLOCK = 1024
_ONE_PASS_MAX = 16384  # columns a row may have to be held in registers (o_proj's 4096 at Qwen3-4B)


def per_token_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (any float dtype) -> (x_q [..., K] float8_e4m3fn, scales [..., 1] float32).

    scale = max(amax of the row, 1e-10) / 448; x_q = clamp(x / scale, -448, 448) in float32.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(_EPS) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `per_token_quant_fp8_ref`; one Triton program per token (the row held in registers up to
    16384 columns, else an amax pass, then a quantize pass over K in chunks of 1024) on CUDA or under the
    interpreter."""
    if not use_triton(x):
        return per_token_quant_fp8_ref(x)
    lead, k = x.shape[:-1], x.shape[-1]  # [..., K], as the reference
    x = x.reshape(-1, k).contiguous()
    m = x.shape[0]
    q = torch.empty((*lead, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((*lead, 1), dtype=torch.float32, device=x.device)
    if m:
        block = next_power_of_2(k) if k <= _ONE_PASS_MAX else _BLOCK
        pdl = pdl_enabled(x.device)
        launch(_per_token_quant_kernel, (m,), x.device, pdl)(x, q, s, k, _EPS, FP8_MAX, BLOCK=block,
                                                             ONE_PASS=k <= _ONE_PASS_MAX, PDL=pdl,
                                                             num_warps=8 if block > 4096 else 4)
    return q, s


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, K, eps, fp8_max, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                            PDL: tl.constexpr):
    """One program per row: its amax, then the quantized row; ONE_PASS (BLOCK >= K) keeps the row in registers
    between the two, else it is read twice in chunks of BLOCK."""
    gdc_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        x = tl.load(x_ptr + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), eps) / fp8_max
        q = tl.clamp(x / scale, -fp8_max, fp8_max)
        tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * K + start + offs, mask=start + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), eps) / fp8_max
        for start in range(0, K, BLOCK):
            mask = start + offs < K
            x = tl.load(x_ptr + row * K + start + offs, mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(x / scale, -fp8_max, fp8_max)
            tl.store(q_ptr + row * K + start + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def channel_scales(w_s: torch.Tensor) -> torch.Tensor:
    """A per-channel layer's scales as stored for the group kernels ([N, G] float32, every column equal,
    strides (1, N) on the GPU) -> [1, N] float32 for scale_b: column 0 (a view when it is contiguous)."""
    return w_s[:, 0].contiguous().view(1, -1)


def fp8_rowwise_gemm_ref(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
                         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Torch reference: a [M, K] fp8, a_s [M, 1], w [N, K] fp8, w_s [1, N] -> [M, N] out_dtype."""
    return ((a.float() @ w.float().t()) * a_s * w_s).to(out_dtype)


def fp8_scaled_mm_rowwise(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
                          out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a [M, K] fp8, a_s [M, 1] float32, w [N, K] fp8, w_s [1, N] float32 -> [M, N] out_dtype through
    ``torch._scaled_mm`` with row-wise scales (CUDA sm89+; K and N multiples of 16; torch supports
    bf16 output for this scaling). Raises what torch raises where it is not supported."""
    return torch._scaled_mm(a, w.t(), scale_a=a_s, scale_b=w_s, out_dtype=out_dtype)


ROWWISE_CONFIGS = (GemmConfig(64, 64, group_m=8, num_warps=4, num_stages=5),
                   GemmConfig(64, 128, group_m=8, num_warps=4, num_stages=4),
                   GemmConfig(128, 128, group_m=8, num_warps=8, num_stages=3))
"""Tile shapes the load-time tuner times for `fp8_rowwise_gemm_triton` (BLOCK_K = 128 bytes of FP8). On the
H200 at Qwen3-4B shapes they beat torch's row-wise scaled_mm (CUTLASS) at 128-256 tokens (o_proj / down_proj
at 256: 14.3 / 29.3 us against 16.7 / 33.4) and tie or lose above 512; 128 x 256 and 64 x 256 tiles never
led (benchmarks/results/2026-12-02-fp8-tune-rowwise-sixteenth.jsonl)."""
ROWWISE_MAX_M = 512
"""Largest token bucket the tuner offers the Triton row-wise GEMM (each candidate costs load time)."""


def fp8_rowwise_gemm_triton(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
                            out_dtype: torch.dtype = torch.bfloat16, config: GemmConfig = ROWWISE_CONFIGS[1]
                            ) -> torch.Tensor:
    """Triton kernel, same contract as `fp8_rowwise_gemm_ref`: a [M, K] fp8 (rows contiguous), a_s [M, 1]
    float32 (any strides), w [N, K] fp8 contiguous, w_s [1, N] float32 contiguous -> [M, N] out_dtype."""
    m, k = a.shape
    n = w.shape[0]
    if a.stride(1) != 1:
        a = a.contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m:
        tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
        launch(_rowwise_gemm_kernel, (tiles,), a.device)(
            a, a_s, w, w_s, out, m, n, k, a.stride(0), a_s.stride(0),
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=128, GROUP_M=config.group_m,
            EVEN_K=k % 128 == 0, num_warps=config.num_warps, num_stages=config.num_stages)
    return out


# stride_a stays specialized: its divisibility by 16 is what lets the A tile load in 16-byte vectors (left
# unspecialized, the tile loaded byte by byte: 5-10x slower than torch's scaled_mm in the first GPU run).
@triton.jit(do_not_specialize=["M", "stride_as"])
def _rowwise_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, stride_a, stride_as,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    pid_m, pid_n = swizzled_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Rows past M / N wrap onto valid ones (their results are never stored), so the operand loads need
    # no mask along M or N and stay vectorized.
    a_ptrs = a_ptr + (rm % M).to(tl.int64)[:, None] * stride_a + rk[None, :]
    w_ptrs = w_ptr + (rn % N).to(tl.int64)[None, :] * K + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(k0 + rk)[None, :] < K, other=0.0)
            w = tl.load(w_ptrs, mask=(k0 + rk)[:, None] < K, other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    a_s = tl.load(as_ptr + (rm % M) * stride_as)
    w_s = tl.load(ws_ptr + rn % N)
    out = acc * a_s[:, None] * w_s[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])
