"""One-token GEMV on bf16 / fp16 / fp32 weights with a software-pipelined weight stream: batch-1 decode's
projections (`fxrewrite.kernels.gemv_dispatch` choice ``("pipelined", block_n, block_k, num_stages, num_warps)``,
timed against the skinny GEMV and cuBLAS per layer shape by the load-time tuner, `fxrewrite.kernels.gemv_tune`).

x [1, K] @ w[N, K]^T (+ bias [N]) -> [1, N] in x's dtype, float32 accumulation. Each program owns BLOCK_N output
rows and walks K in BLOCK_K-column tiles inside ``tl.range(..., num_stages=NUM_STAGES)``, so triton issues the
loads of the next tiles (cp.async into a ring of shared-memory buffers) while the current one is multiplied; the
tile is widened to float32 and multiplied elementwise by x into a float32 accumulator of the tile's shape, reduced
once after the loop (no cross-thread reduction per step). The same loop as the FP8 pipelined GEMV
(`fxrewrite.kernels.fp8_gemv_pipelined`, per-channel form without the scale), which streamed FP8 weights 12-23 %
faster than the register-loaded kernel on an H200 (`benchmarks/results/2026-12-02-gemv-pipelined-eighteenth.json`).

Why beside the skinny GEMV (`fxrewrite.kernels.skinny_gemv`, tiles loaded straight into registers, one in flight
per program): its bf16 decode layers reach ~62 % of the copy bandwidth at Qwen3-4B shapes. In the eighteenth
session's experiment the same loop (`benchmarks/gemv_pipelined.py`, ``ptr``; H200, M = 1, no prologue) was
1.5-4 % faster than the best skinny config at o_proj / down_proj of Qwen3-4B and Qwen3-32B, and from 1 % faster
to 3 % slower at qkv / gate_up: a per-shape choice, hence a tuner candidate rather than a replacement. For the
"norm" / "silu" kinds it also pays the prologue's separate launch, which the skinny GEMV fuses.

Prologues ("norm": RMSNorm with its residual add; "silu": SiLU-and-mul), two forms, both tuner candidates:
`skinny_gemv_pipelined` runs the prologue's own kernel, then this GEMV; `skinny_gemv_pipelined_fused` computes the
prologue inside the loop, as the skinny GEMV does (`fxrewrite.kernels.skinny_gemv._token`: every program recomputes
its slices of silu(gate) * up, or of x + residual with the sum of squares, the 1/rms applied after the dot), so the
prologue's launch disappears at the cost of a second input read (from L2) per weight tile. (Fused into the FP8
pipelined loop the prologues were slower at every Qwen3-32B shape; bf16 at Qwen3-4B shapes is what the tuner
decides.)

Epilogue: ``out_residual`` [1, N] added to the output, rounded as torch's ``out_residual + linear(x)`` (the skinny
GEMV's, `fxrewrite.kernels.skinny_gemv.add_out_residual`), in every form.

Reference: `fxrewrite.kernels.skinny_gemv.skinny_gemv_ref` (the unfused ops then F.linear), same contract.
"""

from __future__ import annotations

import torch

from fxrewrite.kernels.activation import silu_and_mul
from fxrewrite.kernels.pdl import LINE_BYTES, gdc_prologue, pdl_enabled, prefetch_l2, prefetch_lines
from fxrewrite.kernels.rms_norm import rms_norm
from fxrewrite.kernels.skinny_gemv import _check, _load, _token, add_out_residual, skinny_gemv_ref
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["PIPELINED_CONFIGS", "skinny_gemv_pipelined_ref", "skinny_gemv_pipelined_triton", "skinny_gemv_pipelined",
           "skinny_gemv_pipelined_fused", "with_prologue"]

PIPELINED_CONFIGS = ((8, 256, 5, 4), (16, 256, 5, 4), (8, 256, 3, 4), (16, 256, 3, 4), (8, 512, 4, 4),
                     (4, 512, 5, 4))
"""(block_n, block_k, num_stages, num_warps) candidates the tuner times. 4 warps = 128 threads x 8 columns (16-byte
bf16 loads) = 1024 elements per pass over a tile: with block_k 256 each thread holds 8 columns of block_n / 4 rows,
with 512 of block_n / 2; block_n * block_k / 128 float32 accumulators per thread (16-32). The first four led at
some Qwen3-4B / Qwen3-32B shape in the eighteenth session's bf16 sweep (``ptr`` arms, block_k 128 / 256 only);
the two with block_k 512 (1 KB of each row per step, as the skinny GEMV's block_k) were not measured before
being listed. Shared-memory ring: at most num_stages x block_n x block_k x 2 bytes in bf16, 12-40 KB."""


def skinny_gemv_pipelined_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                              out_residual: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of `skinny_gemv_pipelined_triton`: F.linear (x [1, K], w [N, K], bias [N] or None, one
    float dtype) -> [1, N], plus out_residual [1, N] when given."""
    return skinny_gemv_ref(x, w, bias, out_residual=out_residual)


def _refuse(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, config, silu_mul: bool = False) -> None:
    """ValueError unless the kernel can read these operands with this config (x [1, 2K] with silu_mul)."""
    width = 2 * w.shape[1] if silu_mul and w.dim() == 2 else w.shape[-1]
    if x.dim() != 2 or w.dim() != 2 or x.shape[0] != 1 or x.shape[1] != width or x.stride(1) != 1 \
            or not w.is_contiguous():
        raise ValueError(f"skinny_gemv_pipelined: needs x [1, K] with unit column stride and a contiguous weight "
                         f"[N, K]; got x {tuple(x.shape)} strides {x.stride()}, w {tuple(w.shape)}")
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"skinny_gemv_pipelined: x {x.dtype} and w {w.dtype} must be one float dtype "
                         "(bf16 / fp16 / fp32)")
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise ValueError(f"skinny_gemv_pipelined: bias {tuple(bias.shape)}; expected ({w.shape[0]},)")
    if len(config) != 4 or any(not isinstance(c, int) or c < 1 for c in config) \
            or any(c & (c - 1) for c in (config[0], config[1], config[3])):
        raise ValueError(f"skinny_gemv_pipelined: config {config}; expected (block_n, block_k, num_stages, "
                         "num_warps), positive ints, block_n / block_k / num_warps powers of two")


def skinny_gemv_pipelined_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                                 config: tuple[int, ...] = PIPELINED_CONFIGS[0],
                                 out_residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] bf16 / fp16 / fp32 with unit column stride, w [N, K] of x's dtype (contiguous), bias [N] or None
    -> [1, N] in x's dtype (float32 accumulation, bias added before the rounding; out_residual [1, N] of x's dtype
    added after it, as torch's ``out_residual + linear(x)``). config: (block_n, block_k,
    num_stages, num_warps), e.g. one of `PIPELINED_CONFIGS`; block_k is capped at the power of two >= K.
    ValueError for more than one token, mixed dtypes or a layout the kernel cannot read. Launched with PDL where
    `fxrewrite.kernels.pdl` enables it."""
    _refuse(x, w, bias, tuple(config))
    _check(x, w, None, None, False, out_residual)
    return _launch(x, w, bias, tuple(config), out_residual=out_residual)


def skinny_gemv_pipelined_fused(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                                norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                                residual: torch.Tensor | None = None, silu_mul: bool = False,
                                out_residual: torch.Tensor | None = None,
                                config: tuple[int, ...] = PIPELINED_CONFIGS[0]):
    """`skinny_gemv_ref`'s contract at one token (x [1, K], or [1, 2K] with silu_mul; with residual returns (out,
    x + residual)) in one launch: the prologue computed inside the pipelined loop (module docstring). config as
    `skinny_gemv_pipelined_triton`'s. ValueError on shapes that do not fit, more than one token, mixed dtypes or a
    layout the kernel cannot read."""
    _check(x, w, norm_weight, residual, silu_mul, out_residual)
    _refuse(x, w, bias, tuple(config), silu_mul)
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    return _launch(x, w, bias, tuple(config), norm_weight, eps, residual, silu_mul, out_residual)


def _launch(x, w, bias, config, norm_weight=None, eps: float = 1e-6, residual=None, silu_mul: bool = False,
            out_residual=None):
    block_n, block_k, stages, warps = config
    n, k = w.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty((1, k), dtype=x.dtype, device=x.device) if residual is not None else out  # as skinny's
    if n == 0:
        return (out, torch.add(x, residual).to(x.dtype)) if residual is not None else out
    if out_residual is not None and not out_residual.is_contiguous():
        out_residual = out_residual.contiguous()
    block_k = min(block_k, next_power_of_2(k))
    pdl = pdl_enabled(x.device)
    launch(_skinny_gemv_pipelined_kernel, (triton.cdiv(n, block_n),), x.device, pdl)(
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else w, w,
        bias.contiguous() if bias is not None else w, out, res_out, out_residual if out_residual is not None else out,
        1, n, k, float(eps), BLOCK_N=block_n,
        BLOCK_K=block_k, NUM_STAGES=stages, NORM=norm_weight is not None, HAS_RES=residual is not None,
        SILU_MUL=silu_mul, HAS_BIAS=bias is not None, ADD_OUT=out_residual is not None, EVEN_K=k % block_k == 0,
        PDL=pdl,
        PREFETCH_LINES=prefetch_lines(k, w.element_size()), LINE=LINE_BYTES // w.element_size(), num_warps=warps)
    return (out, res_out) if residual is not None else out


def skinny_gemv_pipelined(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                          norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                          residual: torch.Tensor | None = None, silu_mul: bool = False,
                          out_residual: torch.Tensor | None = None, config: tuple[int, ...] = PIPELINED_CONFIGS[0]):
    """`skinny_gemv_ref`'s contract at one token (x [1, K], or [1, 2K] with silu_mul): the prologue's own kernel
    (`rms_norm` with its residual add, or `silu_and_mul`), then `skinny_gemv_pipelined_triton` (with out_residual
    in its epilogue). With residual returns (out, x + residual). ValueError on shapes that do not fit or more than
    one token."""
    _check(x, w, norm_weight, residual, silu_mul, out_residual)
    return with_prologue(lambda h: skinny_gemv_pipelined_triton(h, w, bias, config, out_residual), x, norm_weight,
                         eps, residual, silu_mul)


def with_prologue(gemv, x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                  residual: torch.Tensor | None = None, silu_mul: bool = False):
    """`gemv` (a function of the GEMV's input) after the prologue's own kernel: `silu_and_mul`, or `rms_norm`
    with its residual add (then returns (out, x + residual)), or none. The unfused form of the skinny GEMV's
    prologues, which pays a launch and a round trip of the activation through memory (a few KB at one token)
    but leaves the GEMV loop free of the per-program prologue work."""
    if silu_mul:
        return gemv(silu_and_mul(x))
    if norm_weight is None:
        return gemv(x)
    normed = rms_norm(x, norm_weight, eps, residual)
    if residual is None:
        return gemv(normed)
    return gemv(normed[0]), normed[1]


@triton.jit
def _skinny_gemv_pipelined_kernel(x_ptr, res_ptr, g_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, add_ptr, M, N, K,
                                  eps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                                  NORM: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr,
                                  HAS_BIAS: tl.constexpr, ADD_OUT: tl.constexpr, EVEN_K: tl.constexpr,
                                  PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * K  # a partial last tile re-reads row N - 1
    if PDL:  # weights are never written by a kernel: their first lines start towards L2 during the previous tail
        lines = tl.arange(0, PREFETCH_LINES) * LINE
        prefetch_l2(rows + lines[None, :], (lines < K)[None, :] & (rn < N)[:, None])
    gdc_prologue(PDL)  # x is the previous kernel's output
    rk = tl.arange(0, BLOCK_K)
    first = pid == 0  # the first program writes the new residual (NORM with HAS_RES)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):  # loads of later tiles in flight (cp.async)
        k = k0 + rk
        w = _load(rows + k[None, :], (k < K)[None, :], EVEN_K).to(tl.float32)
        # x's slice as float32 with the prologue applied (M = 1: row 0, no row stride), and its squares for the norm
        x, sq = _token(x_ptr, res_ptr, g_ptr, res_out_ptr, 0, k, M, K, 0, 0, first, NORM, HAS_RES, SILU_MUL, EVEN_K)
        acc += w * x[None, :]
        if NORM:
            ss += sq
    total = tl.sum(acc, axis=1)  # the one reduction over K
    if NORM:
        total = total * tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    if HAS_BIAS:
        total += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn, add_out_residual(total, add_ptr, rn, rn < N, out_ptr.dtype.element_ty, ADD_OUT), mask=rn < N)
