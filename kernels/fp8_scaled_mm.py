"""Block-scaled FP8 GEMM through torch's scaled matmul (cuBLASLt's DeepSeek-style 1x128 / 128x128
scaling, Hopper only, cuBLASLt >= 12.9); reference: `fxrewrite.kernels.fp8_gemm.fp8_block_gemm_ref`.

torch 2.11 - 2.13 (``aten/src/ATen/native/cuda/ScaledBlas.cpp``, ``_scaled_block1x128_block128x128``,
mirrored by ``torch/_meta_registrations.py``) accept, for out [M, N] = a [M, K] @ b [K, N]:

- a: float8_e4m3fn [M, K] row-major; b: float8_e4m3fn [K, N] column-major (our [N, K] weight's ``.t()``);
- activation scales (``ScalingType.BlockWise1x128``): float32 [M, ceil(K/128)] with strides (1, M),
  i.e. outer-dim (M) major; for M = 1 the strides must be (1, 1), which ``.t().contiguous().t()``
  does not give (it returns the row-major tensor unchanged), so the layout is built explicitly;
- weight scales (``ScalingType.BlockWise128x128``): float32 [L4, ceil(N/128)] with strides (1, L4),
  L4 = ceil(K/128) rounded up to a multiple of 4, i.e. the checkpoint's [ceil(N/128), ceil(K/128)]
  block scales padded to L4 columns and transposed;
- or per-row weight scales (``BlockWise1x128`` for b too): float32 [N, ceil(K/128)] with strides (1, N).

`F.scaled_mm` (torch >= 2.10's public wrapper of ``_scaled_mm_v2``) is used when present, else
``torch._scaled_mm``, which picks the same kernel from the scale shapes. K and N must be multiples of
16 (cuBLASLt FP8).

Token counts: the activation scales' leading dimension is M, and on the H200 (torch 2.11 + cu130) a
CUDA-graph capture of the engine failed with CUBLAS_STATUS_NOT_SUPPORTED from
``cublasLtMatmulAlgoGetHeuristic`` at a small batch while M = 8 had worked, consistent with cuBLASLt
wanting 16-byte-aligned scale columns (M a multiple of 4, as it wants L4 for the 128 x 128 weight
scales). So `fp8_scaled_mm` pads a and a_s to a multiple of `PAD_M` rows (the padding rows' outputs
are dropped). That is a reading of the failure, not a documented rule: the load-time tuner
(fp8_tune.py) still runs and captures this backend at every token count it may get before choosing it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["activation_scales_outer_major", "weight_block_scales_for_scaled_mm", "row_scales_for_scaled_mm",
           "scaled_mm_supported_shape", "fp8_scaled_mm", "PAD_M"]

PAD_M = 4


def activation_scales_outer_major(a_s: torch.Tensor) -> torch.Tensor:
    """a_s [M, G] float32 (any layout) -> the same values with strides (1, M)."""
    m, g = a_s.shape
    out = torch.empty_strided((m, g), (1, max(m, 1)), dtype=torch.float32, device=a_s.device)
    out.copy_(a_s)
    return out


def weight_block_scales_for_scaled_mm(w_blocks: torch.Tensor) -> torch.Tensor:
    """Checkpoint block scales [ceil(N/128), G] float32 -> [L4, ceil(N/128)] with strides (1, L4),
    L4 = G rounded up to a multiple of 4 (the padding columns are never read for valid K)."""
    nb, g = w_blocks.shape
    l4 = -(-g // 4) * 4
    padded = torch.ones(nb, l4, dtype=torch.float32, device=w_blocks.device)
    padded[:, :g] = w_blocks
    return padded.t()


def row_scales_for_scaled_mm(w_s: torch.Tensor) -> torch.Tensor:
    """Per-row weight scales [N, G] float32 -> strides (1, N) (``BlockWise1x128`` on the weight)."""
    return activation_scales_outer_major(w_s)


def scaled_mm_supported_shape(n: int, k: int) -> bool:
    """cuBLASLt FP8 needs K and N multiples of 16."""
    return n % 16 == 0 and k % 16 == 0


def fp8_scaled_mm(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor,
                  out_dtype: torch.dtype = torch.bfloat16, per_row: bool = False) -> torch.Tensor:
    """a [M, K] fp8, a_s [M, G] float32, w [N, K] fp8 -> [M, N] out_dtype (bf16 / fp16 / fp32).

    w_scales: `weight_block_scales_for_scaled_mm` output (128 x 128 blocks), or with per_row
    `row_scales_for_scaled_mm` output. Raises what torch raises (RuntimeError / ValueError /
    NotImplementedError) where the GPU, cuBLASLt or the shapes do not support it.
    """
    m = a.shape[0]
    if m % PAD_M:
        pad = PAD_M - m % PAD_M
        padded = torch.zeros(m + pad, a.shape[1], dtype=torch.uint8, device=a.device).view(a.dtype)
        padded[:m].copy_(a)  # a byte copy (no FP8 arithmetic kernels needed)
        scales = torch.ones(m + pad, a_s.shape[1], dtype=a_s.dtype, device=a_s.device)
        scales[:m].copy_(a_s)
        a, a_s = padded, scales
    if a_s.stride(0) != 1 or (a_s.shape[0] > 1 and a_s.stride(1) != a_s.shape[0]):
        a_s = activation_scales_outer_major(a_s)
    if hasattr(F, "scaled_mm"):
        st = F.ScalingType
        recipe_b = st.BlockWise1x128 if per_row else st.BlockWise128x128
        out = F.scaled_mm(a, w.t(), a_s, st.BlockWise1x128, w_scales, recipe_b, output_dtype=out_dtype)
    elif per_row:
        raise NotImplementedError("per-row FP8 weight scales need torch.nn.functional.scaled_mm (torch >= 2.10)")
    else:
        out = torch._scaled_mm(a, w.t(), scale_a=a_s, scale_b=w_scales, out_dtype=out_dtype)
    return out[:m]
