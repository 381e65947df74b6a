"""Which block-scaled FP8 GEMM runs for a layer's (N, K) at a token count M: the Triton kernel (its
default tile table or an alternative config) or torch's scaled_mm (cuBLASLt), measured once per
(N, K, M bucket) on the device when an FP8 model is loaded (`tune`), before CUDA graphs are captured.

Why measure: on the H200 the first Triton tiling beat bf16 only at M <= 16 and lost 2-4x from M = 128
(benchmarks/results/2026-11-30-fp8-gemm.json), and which of cuBLASLt / Triton wins depends on M and
the shape; at decode sizes a tensor-core-free matrix-vector kernel (fp8_gemv.py) competes too. A token
count maps to the smallest bucket holding it (above 8192: the 8192 bucket); a bucket never tuned
(FP8 layers used before `tune`, or without it) runs the Triton default table. ``FXREWRITE_FP8_GEMM=triton`` or
``=scaled_mm`` forces one backend (``auto``, the default, measures).

The weight scales are per row, [N, ceil(K/128)], stored outer-dim major (strides (1, N)): the layout
scaled_mm's ``BlockWise1x128`` takes for the weight, which the Triton kernel reads as well.
"""

from __future__ import annotations

import os

import torch

from fxrewrite.kernels import use_triton
from fxrewrite.kernels.fp8_gemm import (
    ALT_CONFIGS,
    config_for,
    fp8_block_gemm_triton,
    fp8_linear,
    per_token_group_quant_fp8,
)
from fxrewrite.kernels.fp8_gemv import GEMV_CONFIGS, GEMV_MAX_M, fp8_block_gemv_triton
from fxrewrite.kernels.fp8_scaled_mm import fp8_scaled_mm, scaled_mm_supported_shape

__all__ = ["BUCKETS", "bucket_of", "choose", "tune", "fp8_gemm_dispatch", "fp8_linear_dispatch", "clear"]

BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_choices: dict[tuple[int, int, int], str] = {}
"""(N, K, bucket) -> "triton" | "triton:<index into ALT_CONFIGS>" | "gemv:<index into GEMV_CONFIGS>" |
"scaled_mm"."""


def bucket_of(m: int) -> int:
    return next((b for b in BUCKETS if m <= b), BUCKETS[-1])


def _forced() -> str:
    value = os.environ.get("FXREWRITE_FP8_GEMM", "auto")
    if value not in ("auto", "triton", "scaled_mm"):
        raise ValueError(f"FXREWRITE_FP8_GEMM={value!r}; expected 'auto', 'triton' or 'scaled_mm'")
    return value


def choose(n: int, k: int, m: int) -> str:
    """The backend for an [m, k] x [n, k]^T product (see the module docstring)."""
    forced = _forced()
    if forced != "auto":
        return forced
    return _choices.get((n, k, bucket_of(m)), "triton")


def fp8_gemm_dispatch(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
                      out_dtype: torch.dtype, backend: str | None = None) -> torch.Tensor:
    """a [M, K] fp8, a_s [M, G] float32 (outer-dim major), w [N, K] fp8, w_s [N, G] float32 -> [M, N]."""
    backend = backend or choose(w.shape[0], w.shape[1], a.shape[0])
    if backend == "scaled_mm":
        return fp8_scaled_mm(a, a_s, w, w_s, out_dtype, per_row=True)
    if backend.startswith("gemv:"):
        block_n, target = GEMV_CONFIGS[int(backend.split(":")[1])]
        return fp8_block_gemv_triton(a, a_s, w, w_s, out_dtype, block_n, target)
    config = ALT_CONFIGS[int(backend.split(":")[1])] if ":" in backend else None
    return fp8_block_gemm_triton(a, a_s, w, w_s, 128, out_dtype, config)


def fp8_linear_dispatch(x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """`fxrewrite.kernels.fp8_gemm.fp8_linear` with the backend `choose` picks (the torch reference on a
    CPU without the Triton interpreter, and for scale groups other than 128)."""
    if group_size != 128 or not use_triton(x):
        return fp8_linear(x, w, w_s, group_size)
    lead = x.shape[:-1]
    q, s = per_token_group_quant_fp8(x.reshape(-1, x.shape[-1]), group_size, column_major_scales=True)
    return fp8_gemm_dispatch(q, s, w, w_s, x.dtype).reshape(*lead, w.shape[0])


def _candidates(n: int, k: int, m: int) -> list[str]:
    names = ["triton"]
    if m <= GEMV_MAX_M:
        names += [f"gemv:{i}" for i in range(len(GEMV_CONFIGS))]
    if m > 64:
        names += [f"triton:{i}" for i, cfg in enumerate(ALT_CONFIGS) if cfg != config_for(m)]
    if scaled_mm_supported_shape(n, k):
        names.append("scaled_mm")
    return names


def _time_ms(fn, reps: int = 10) -> float:
    fn()  # compile / warm up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def tune(shapes: set[tuple[int, int]], device: torch.device, out_dtype: torch.dtype = torch.bfloat16,
         buckets: tuple[int, ...] = BUCKETS) -> dict[tuple[int, int, int], dict[str, float]]:
    """Time every candidate for each (N, K) in `shapes` at each of `buckets`; keep the fastest.

    Returns {(N, K, bucket): {backend: ms}}; a backend that raises (e.g. scaled_mm on a GPU or torch
    without block scaling) is left out. No-op (returns {}) unless FXREWRITE_FP8_GEMM is auto.
    """
    if _forced() != "auto":
        return {}
    timings = {}
    for n, k in sorted(shapes):
        w = torch.randn(n, k, device=device, dtype=torch.float32).div_(8).to(torch.float8_e4m3fn)
        g = -(-k // 128)
        w_s = torch.rand(g, n, device=device, dtype=torch.float32).add_(0.5).div_(448).t()  # strides (1, N)
        for b in buckets:
            a, a_s = per_token_group_quant_fp8(torch.randn(b, k, device=device, dtype=out_dtype),
                                               column_major_scales=True)
            times = {}
            for name in _candidates(n, k, b):
                try:
                    times[name] = _time_ms(lambda: fp8_gemm_dispatch(a, a_s, w, w_s, out_dtype, name))
                except Exception:  # noqa: BLE001 - an unsupported backend is simply not a candidate
                    continue
            _choices[(n, k, b)] = min(times, key=times.get)
            timings[(n, k, b)] = times
        del w, w_s
    torch.cuda.empty_cache()  # the scratch tensors must not count as used when the KV cache is sized
    return timings


def clear() -> None:
    """Forget every measured choice (tests)."""
    _choices.clear()
