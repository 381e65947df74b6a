"""One-token FP8 matrix-vector product with a software-pipelined weight stream: batch-1 decode's FP8 GEMM
(`fxrewrite.kernels.fp8_dispatch` backend ``gemv_pipelined:<i>``, chosen per layer shape by the load-time tuner).

Weight-only: x [1, K] stays in its float dtype, w [N, K] is float8_e4m3fn with float32 scales w_s [N, ceil(K/128)],
one per row and 128-column group (FP8 checkpoints) or per row (``quantization="fp8"`` on a float checkpoint,
stored repeated over the groups). Each program owns BLOCK_N output rows and walks K in BLOCK_K-column tiles
inside ``tl.range(..., num_stages=NUM_STAGES)``, so triton issues the loads of the next tiles (cp.async into a
ring of shared-memory buffers) while the current one is multiplied; the tile is widened to float32 and multiplied
elementwise by x into a float32 accumulator of the tile's shape, reduced once after the loop (no cross-thread
reduction per step). Per-channel: the row scale multiplies the reduced sum (sum_k s_n w[n, k] x[k] =
s_n sum_k w[n, k] x[k]). Block-scaled, when every row of a tile shares its scales (``scale_rows``, the aligned
run of rows with one scale row, is a multiple of BLOCK_N: checkpoint layers whose fused parts and shards start on
such a row, which the layer knows from its shapes), the loop is the per-channel one with x scaled first: the
step's BLOCK_K / 128 scales of the tile's first row are loaded and broadcast over their 128 columns of x
(sum_k s_g(k) w[n, k] x[k]: BLOCK_K products per step rather than BLOCK_N * BLOCK_K). Otherwise the tile is
[BLOCK_N, BLOCK_K / 128, 128] and the step's [BLOCK_N, BLOCK_K / 128] scales multiply it before the
accumulation.

Why a second FP8 GEMV beside `fp8_gemv` (which splits K over programs and reduces per 128-column group every
step, loading each tile straight into registers): on the H200 at one token the pipelined loop streamed
per-channel weights 12-23 % faster at Qwen3-32B's shapes
(`benchmarks/results/2026-12-02-gemv-pipelined-eighteenth.json`: gate_up 62.6 against 70.3 us, down 34.0
against 41.3, o_proj 12.8 against 18.0). Block-scaled with shared scales it streams as fast
(`2026-12-02-fp8-gemm-shared-nineteenth.json`, Qwen3-32B qkv / o / gate_up / down 15.8 / 13.4 / 64.9 / 34.8 us,
against 17.6 / 17.1 / 68.0 / 38.9 for `gemv:<i>` in the same run); the per-element form lost at 32B gate_up / down
(`2026-12-02-fp8-gemm-pipelined-block-eighteenth.json`), and two other ways of sharing the scales were slower:
gathering a scale per column of x (2-4x: `2026-12-02-fp8-gemm-32b-shared-2d-nineteenth.json`) and scaling
[GROUPS, 128] slices of x in the 3-D tile (10-20 % at 32B gate_up / down: `...-shared-3d-nineteenth.json`).
The tuner keeps whichever backend is faster per shape. RMSNorm / SiLU-and-mul fused into this loop (as the skinny
GEMV fuses them) were slower than the separate kernel plus this GEMV at every Qwen3-32B shape
(`2026-12-02-gemv-tune-pipelined-prologue-nineteenth.jsonl`): not kept. SiLU-and-mul in gate_up's epilogue instead
(each program streaming its gate rows and the matching up rows, commit 655f751, reverted) was no faster in the
engine: Qwen3-32B block-FP8 batch 1, one H200 call, graph replay 9.172 ms without / 9.228 with, 103.5 / 102.3
tokens/s (`2026-12-04-qwen3-32b-fp8-block-latency-gated-{0,1}-thirty-third.json`).

Reference: `fxrewrite.kernels.fp8_gemv.fp8_weight_only_gemv_ref` (the product with the dequantized weight in
float32, rounded to x's dtype).
"""

from __future__ import annotations

import torch

from fxrewrite.kernels.pdl import LINE_BYTES, fp8_gemv_pdl, prefetch_l2, prefetch_lines
from fxrewrite.kernels.triton_utils import launch, tl, triton

__all__ = ["PIPELINED_CONFIGS", "fp8_gemv_pipelined_triton"]

PIPELINED_CONFIGS = ((8, 512, 5, 4), (16, 512, 5, 4), (16, 256, 5, 4), (8, 512, 3, 4), (4, 512, 5, 4),
                     (32, 256, 5, 4), (16, 512, 6, 4), (8, 1024, 4, 4))
"""(block_n, block_k, num_stages, num_warps) candidates the tuner times: the five that led at some Qwen3-4B /
Qwen3-32B shape in the first sweep named in the module docstring (per-channel weights, M = 1), then three that led
in a wider sweep of block-scaled weights with shared scales (H200, `2026-12-04-fp8-gemv-mma-thirty-third.json`, us
against the best of the first five): Qwen3-32B qkv / gate_up 15.5 / 64.0 against 15.7 / 65.0 (32 x 256), Qwen3-4B
gate_up 15.5 against 16.7 (16 x 512, 6 stages), Qwen3-4B o_proj / down 5.6 / 9.3 against 5.8 / 10.2 (8 x 1024).
The same sweep put the product on tensor cores (weights widened to float16, x row 0 of a [16, BLOCK_K] operand,
`benchmarks/fp8_gemv_mma.py`): 1.3-2.1x slower at every shape."""


def fp8_gemv_pipelined_triton(x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, config: tuple[int, ...],
                              per_channel: bool = True, scale_rows: int = 1) -> torch.Tensor:
    """x [1, K] bf16 / fp16 / fp32 with unit column stride, w [N, K] float8_e4m3fn (contiguous), w_s
    [N, ceil(K/128)] float32 in any strides -> [1, N] in x's dtype. per_channel: every column of w_s is the row's
    scale (as the FP8 layers store per-channel scales; column 0 is read), else one scale per row and 128-column
    group. scale_rows (block-scaled): rows [i * scale_rows, (i + 1) * scale_rows) of w_s are equal for every i
    (the caller's promise; 1 promises nothing). config: (block_n, block_k, num_stages, num_warps), powers of two
    with block_k >= 128, e.g. one of `PIPELINED_CONFIGS`. ValueError for more than one token or a layout the
    kernel cannot read."""
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1 or not w.is_contiguous() or x.shape[1] != w.shape[1]:
        raise ValueError(f"fp8_gemv_pipelined: needs x [1, K] with unit column stride and a contiguous weight "
                         f"[N, K]; got x {tuple(x.shape)} strides {x.stride()}, w {tuple(w.shape)}")
    if w_s.dim() != 2 or tuple(w_s.shape) != (w.shape[0], -(-w.shape[1] // 128)):
        raise ValueError(f"fp8_gemv_pipelined: scales {tuple(w_s.shape)}; expected one per output row and "
                         f"128-column group, {(w.shape[0], -(-w.shape[1] // 128))}")
    block_n, block_k, stages, warps = config
    if block_k % 128:
        raise ValueError(f"fp8_gemv_pipelined: block_k {block_k} is not a multiple of the 128-column scale group")
    n, k = w.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    pdl, trigger = fp8_gemv_pdl(x.device)  # under auto: a plain launch that lets the next kernel start early
    launch(_pipelined_gemv_kernel, (triton.cdiv(n, block_n),), x.device, pdl)(
        x, w, w_s, out, n, k, w_s.stride(0), w_s.stride(1), BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages,
        PER_CHANNEL=per_channel, SHARED_SCALES=not per_channel and scale_rows % block_n == 0, PDL=pdl, TRIGGER=trigger,
        PREFETCH_LINES=prefetch_lines(k, w.element_size()), LINE=LINE_BYTES // w.element_size(), num_warps=warps)
    return out


@triton.jit
def _pipelined_gemv_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, N, K, stride_ws_n, stride_ws_g, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PER_CHANNEL: tl.constexpr,
                           SHARED_SCALES: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr,
                           PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.minimum(rn, N - 1)  # a partial last tile re-reads row N - 1; its outputs are not stored
    if PDL:  # weights are never written by a kernel: their first lines start towards L2 during the previous tail
        lines = tl.arange(0, PREFETCH_LINES) * LINE
        prefetch_l2(w_ptr + row.to(tl.int64)[:, None] * K + lines[None, :], (lines < K)[None, :] & (rn < N)[:, None])
    if PDL:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    if TRIGGER:  # also from a plain launch: the next PDL kernel's programs may start during this one's last wave
        tl.extra.cuda.gdc_launch_dependents()
    if PER_CHANNEL or SHARED_SCALES:
        rows = w_ptr + row.to(tl.int64)[:, None] * K
        rk = tl.arange(0, BLOCK_K)
        GROUPS_X: tl.constexpr = BLOCK_K // 128
        rg_x = tl.arange(0, GROUPS_X)
        first_scales = ws_ptr + tl.program_id(0) * BLOCK_N * stride_ws_n  # the tile's first row of scales
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            k = k0 + rk
            w = tl.load(rows + k[None, :], mask=(k < K)[None, :], other=0.0).to(tl.float32)
            x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            if SHARED_SCALES:  # every row's scales are the first row's: scale x, BLOCK_K products
                g = k0 // 128 + rg_x
                s1 = tl.load(first_scales + g * stride_ws_g, mask=g * 128 < K, other=0.0)  # [GROUPS]
                x = tl.reshape(tl.reshape(x, (GROUPS_X, 128)) * s1[:, None], (BLOCK_K,))
            acc += w * x[None, :]
        total = tl.sum(acc, axis=1)
        if PER_CHANNEL:
            total = total * tl.load(ws_ptr + row * stride_ws_n)
    else:  # [BLOCK_N, GROUPS, 128] tiles: one scale per (row, group) and step, broadcast over its 128 columns
        GROUPS: tl.constexpr = BLOCK_K // 128
        rows3 = w_ptr + row.to(tl.int64)[:, None, None] * K
        rg = tl.arange(0, GROUPS)
        cols = rg[:, None] * 128 + tl.arange(0, 128)[None, :]  # [GROUPS, 128]
        acc3 = tl.zeros((BLOCK_N, GROUPS, 128), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            kk = k0 + cols
            w3 = tl.load(rows3 + kk[None, :, :], mask=(kk < K)[None, :, :], other=0.0).to(tl.float32)
            x3 = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            g = k0 // 128 + rg
            s = tl.load(ws_ptr + row[:, None] * stride_ws_n + g[None, :] * stride_ws_g,
                        mask=(g * 128 < K)[None, :], other=0.0)  # [BLOCK_N, GROUPS]
            acc3 += w3 * x3[None, :, :] * s[:, :, None]
        total = tl.sum(tl.sum(acc3, axis=2), axis=1)
    tl.store(out_ptr + rn, total.to(out_ptr.dtype.element_ty), mask=rn < N)
