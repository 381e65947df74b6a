"""Load-time choice between the skinny GEMV and cuBLAS per (kind, N, K, token bucket), measured on the device
before the engine captures its decode CUDA graphs (records into `fxrewrite.kernels.gemv_dispatch`).

For each bucket the baseline is what the model runs without the GEMV: for "linear" ``F.linear``
(cuBLAS); for "norm" the RMSNorm kernel with its residual add, then ``F.linear``; for "silu" the
SiLU-and-mul kernel, then ``F.linear``. Every candidate config of `skinny_gemv.configs_for(bucket, kind, N)`
(split-K ones included for a narrow "linear" / "silu" output) and the baseline are timed as
`fxrewrite.kernels.fp8_tune` times its backends: a CUDA graph of 20 calls over enough weight copies to
overflow the 50 MB L2 (each call streams its weight from HBM, as a decode step does), replayed and timed
with CUDA events (kernels launched with PDL where `fxrewrite.kernels.pdl` enables it, as the engine runs them). A config must first match the baseline at the bucket's
smallest and largest token count (max error relative to the largest output < `TOLERANCE`: bf16
rounding differs by ~1e-2, a wrong prologue by ~1). The fastest passing config is recorded when it beats
the baseline; otherwise the bucket records None (cuBLAS).
"""

from __future__ import annotations

import json
import logging
import os

import torch
import torch.nn.functional as F

from fxrewrite.kernels import gemv_dispatch
from fxrewrite.kernels.activation import silu_and_mul
from fxrewrite.kernels.fp8_tune import graph_time_us
from fxrewrite.kernels.rms_norm import rms_norm
from fxrewrite.kernels.skinny_gemv import GEMV_MAX_M, configs_for, skinny_gemv_triton

__all__ = ["TOLERANCE", "BUCKETS", "make_inputs", "scratch_weights", "max_rel_error", "baseline", "candidate",
           "tune_shape", "tune"]

logger = logging.getLogger(__name__)

TOLERANCE = 0.03
BUCKETS = (1, 2, 4, 8)
_L2_BYTES = 128 << 20  # weight copies per timing graph: > 2x the H200's 50 MB L2


def make_inputs(kind: str, m: int, k: int, device, dtype, seed: int = 0) -> dict:
    """Random keyword arguments x (and residual, norm_weight) of one `kind` call with m tokens."""
    gen = torch.Generator(device=device).manual_seed(seed)
    width = 2 * k if kind == "silu" else k
    args = {"x": torch.randn(m, width, device=device, dtype=dtype, generator=gen)}
    if kind == "norm":
        args["residual"] = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
        args["norm_weight"] = torch.rand(k, device=device, dtype=dtype, generator=gen) + 0.5
    return args


def baseline(kind: str, w: torch.Tensor, x: torch.Tensor, residual=None, norm_weight=None) -> torch.Tensor:
    """The unfused kernels + cuBLAS for one call of `kind` (what runs when the GEMV is not chosen)."""
    if kind == "silu":
        x = silu_and_mul(x)
    elif kind == "norm":
        x = rms_norm(x, norm_weight, 1e-6, residual)[0]
    return F.linear(x, w)


def candidate(kind: str, w: torch.Tensor, x: torch.Tensor, config, residual=None, norm_weight=None) -> torch.Tensor:
    """The skinny GEMV with `config` for one call of `kind`."""
    out = skinny_gemv_triton(x, w, norm_weight=norm_weight, eps=1e-6, residual=residual, silu_mul=kind == "silu",
                             config=config)
    return out[0] if kind == "norm" else out


def max_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def _proven(kind: str, w: torch.Tensor, bucket: int, config) -> None:
    """Raise unless `config` matches the baseline at the bucket's smallest and largest token count."""
    for m in sorted({bucket // 2 + 1, bucket}):
        args = make_inputs(kind, m, w.shape[1], w.device, w.dtype, seed=m)
        err = max_rel_error(candidate(kind, w, config=config, **args), baseline(kind, w, **args))
        if not err < TOLERANCE:
            raise ValueError(f"M={m}: max relative error {err:.3g} >= {TOLERANCE}")


def tune_shape(kind: str, ws: list[torch.Tensor], bucket: int) -> dict[str, float | str]:
    """{"cublas" | "block_n/block_k/warps": us per call, or "error: ..."} for one bucket; records the
    choice in gemv_dispatch."""
    n, k = ws[0].shape
    args = make_inputs(kind, bucket, k, ws[0].device, ws[0].dtype)
    results: dict[str, float | str] = {"cublas": graph_time_us(lambda i: baseline(kind, ws[i], **args), 20, len(ws))}
    best = None
    for config in configs_for(bucket, kind, n):
        name = "/".join(map(str, config))
        try:
            _proven(kind, ws[0], bucket, config)
            results[name] = graph_time_us(lambda i, c=config: candidate(kind, ws[i], config=c, **args), 20, len(ws))
        except Exception as e:  # noqa: BLE001 - a config that fails or is wrong here is never chosen
            results[name] = f"error: {type(e).__name__}: {str(e)[:200]}"
            continue
        if results[name] < results["cublas"] and (best is None or results[name] < results[best[0]]):
            best = (name, config)
    gemv_dispatch.record(kind, n, k, bucket, best[1] if best else None)
    return results


def scratch_weights(n: int, k: int, device, dtype) -> list[torch.Tensor]:
    """Random [n, k] weight copies, as many as overflow the L2 twice (at most 8)."""
    copies = max(1, min(8, -(-_L2_BYTES // (n * k * torch.tensor([], dtype=dtype).element_size()))))
    return [torch.randn(n, k, device=device, dtype=dtype).div_(k ** 0.5) for _ in range(copies)]


def tune(shapes: set[tuple[str, int, int]], device, dtype: torch.dtype, max_m: int = GEMV_MAX_M) -> dict:
    """Measure every (kind, N, K) in `shapes` at each bucket <= min(max_m, GEMV_MAX_M) (the decode batch
    sizes the engine will run) and record the choices. Returns {"kind NxK@bucket": {name: us or error}}.
    No-op ({}) unless FXREWRITE_GEMV is "auto" and `device` is CUDA. FXREWRITE_GEMV_TUNE_LOG=path appends
    one JSON line of choices and timings."""
    if gemv_dispatch.mode() != "auto" or torch.device(device).type != "cuda":
        return {}
    buckets = [b for b in BUCKETS if b <= max(1, max_m)]
    timings = {}
    for kind, n, k in sorted(shapes):
        try:
            ws = scratch_weights(n, k, device, dtype)
        except torch.cuda.OutOfMemoryError:  # no room for a scratch copy: this shape keeps cuBLAS
            logger.warning("skinny GEMV: no memory to time %s %dx%d; it keeps cuBLAS", kind, n, k)
            continue
        for b in buckets:
            timings[f"{kind} {n}x{k}@{b}"] = tune_shape(kind, ws, b)
        del ws
    torch.cuda.empty_cache()  # the scratch weights must not count as used when the KV cache is sized
    logger.info("skinny GEMV choices: %s", gemv_dispatch.choices())
    if os.environ.get("FXREWRITE_GEMV_TUNE_LOG"):
        with open(os.environ["FXREWRITE_GEMV_TUNE_LOG"], "a") as f:
            f.write(json.dumps({"choices": gemv_dispatch.choices(), "timings_us": timings}) + "\n")
    return timings
