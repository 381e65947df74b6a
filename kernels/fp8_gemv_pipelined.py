"""One-token FP8 matrix-vector product with a software-pipelined weight stream, for per-channel FP8 weights:
batch-1 decode's FP8 GEMM (`fxrewrite.kernels.fp8_dispatch` backend ``gemv_pipelined:<i>``, chosen by the
load-time tuner).

Weight-only: x [1, K] stays in its float dtype, w [N, K] is float8_e4m3fn with one float32 scale per output row
(``quantization="fp8"`` on a float checkpoint). Each program owns BLOCK_N output rows and walks K in
[BLOCK_N, BLOCK_K] tiles inside ``tl.range(..., num_stages=NUM_STAGES)``, so triton issues the loads of the next
tiles while the current one is multiplied; the tile is widened to float32 and multiplied elementwise by x into a
[BLOCK_N, BLOCK_K] float32 accumulator reduced once after the loop (no cross-thread reduction per step), and the
row scale multiplies the sum: sum_k s_n w[n, k] x[k] = s_n sum_k w[n, k] x[k].

Why a second FP8 GEMV beside `fp8_gemv` (which splits K over programs and reduces per 128-column group every
step): on the H200 at Qwen3-32B's decode shapes this loop streamed per-channel weights 12-23 % faster than every
FP8 backend the tuner had (`benchmarks/results/2026-12-02-gemv-pipelined-eighteenth.json`: gate_up 62.6 against
70.3 us, down 34.0 against 41.3, o_proj 12.8 against 18.0). Block-scaled weights are not offered to it: with the
scale of each element's (row, 128-column group) gathered per tile (scales stored outer-dim major) it ran 7-25x
slower than `fp8_gemv` (`2026-12-02-fp8-tune-pipelined-2-eighteenth.jsonl`), and that form was removed.

Reference: `fxrewrite.kernels.fp8_gemv.fp8_weight_only_gemv_ref` (the product with the dequantized weight in
float32, rounded to x's dtype).
"""

from __future__ import annotations

import torch

from fxrewrite.kernels.triton_utils import launch, tl, triton

__all__ = ["PIPELINED_CONFIGS", "fp8_gemv_pipelined_triton"]

PIPELINED_CONFIGS = ((8, 512, 5, 4), (16, 512, 5, 4), (16, 256, 5, 4), (8, 512, 3, 4), (4, 512, 5, 4))
"""(block_n, block_k, num_stages, num_warps) candidates the tuner times: the five that led at some Qwen3-4B /
Qwen3-32B shape in the sweep named in the module docstring (per-channel weights, M = 1)."""


def fp8_gemv_pipelined_triton(x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
                              config: tuple[int, ...]) -> torch.Tensor:
    """x [1, K] bf16 / fp16 / fp32 with unit column stride, w [N, K] float8_e4m3fn (contiguous), w_s [N, G]
    float32 per-channel scales in any strides (every column equal, as the FP8 layers store them; column 0 is
    read) -> [1, N] in x's dtype. config: (block_n, block_k, num_stages, num_warps), powers of two, e.g. one of
    `PIPELINED_CONFIGS`. ValueError for more than one token or a layout the kernel cannot read."""
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1 or not w.is_contiguous() or x.shape[1] != w.shape[1]:
        raise ValueError(f"fp8_gemv_pipelined: needs x [1, K] with unit column stride and a contiguous weight "
                         f"[N, K]; got x {tuple(x.shape)} strides {x.stride()}, w {tuple(w.shape)}")
    if w_s.dim() != 2 or w_s.shape[0] != w.shape[0]:
        raise ValueError(f"fp8_gemv_pipelined: scales {tuple(w_s.shape)} do not have one row per output "
                         f"({w.shape[0]})")
    block_n, block_k, stages, warps = config
    n, k = w.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    launch(_pipelined_gemv_kernel, (triton.cdiv(n, block_n),), x.device)(
        x, w, w_s, out, n, k, w_s.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, num_warps=warps)
    return out


@triton.jit
def _pipelined_gemv_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, N, K, stride_ws_n, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.minimum(rn, N - 1)  # a partial last tile re-reads row N - 1; its outputs are not stored
    rows = w_ptr + row.to(tl.int64)[:, None] * K
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + rk
        w = tl.load(rows + k[None, :], mask=(k < K)[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        acc += w * x[None, :]
    total = tl.sum(acc, axis=1) * tl.load(ws_ptr + row * stride_ws_n)
    tl.store(out_ptr + rn, total.to(out_ptr.dtype.element_ty), mask=rn < N)
