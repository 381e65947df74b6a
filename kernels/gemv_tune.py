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

At one token on float weights the candidates (`candidates`) also hold the software-pipelined GEMV's configs,
tagged ``("pipelined", block_n, block_k, num_stages, num_warps)`` (`fxrewrite.kernels.skinny_gemv_pipelined`): for
"norm" / "silu" the prologue's own kernel then the pipelined GEMV, for "linear" the GEMV alone; for "norm" / "silu" the
pipelined GEMV with the prologue in its loop, tagged ``("pipelined-fused", ...)``, and the prologue's own kernel then
the skinny GEMV's plain-linear configs, tagged ``("unfused", ...)``. They are proven
and timed like the skinny configs, and the recorded choice says which kernel runs (`gemv_dispatch.run`).

FP8 weights (formats "fp8" / "fp8-channel", `fxrewrite.kernels.skinny_gemv_fp8`): the baseline is the
prologue's kernel then `fp8_dispatch.fp8_linear_dispatch` (the backend the FP8 tuner chose for that
bucket, which runs first at load), and a config is proven against `skinny_gemv_fp8_ref` (the float32
product with the dequantized weight) instead, since the FP8 GEMMs quantize the activations and this
kernel does not. A block-scaled shape carries the layers' ``scale_rows`` (rows sharing one scale row,
`fxrewrite.layers.fp8_linear`): its scratch scales are equal in such runs and the baseline is passed it, so the
baseline is the pipelined GEMV's shared-scale form the layer runs. Timed without it (per-element scales), the
baseline was slower than the layer's own product and the skinny GEMV took Qwen3-32B's block-FP8 o_proj at
16.5 us a call, where the shared-scale GEMV took ~13 us in the FP8 tuner.
"""

from __future__ import annotations

import json
import logging
import os

import torch
import torch.nn.functional as F

from fxrewrite.kernels import env_choice, gemv_dispatch
from fxrewrite.kernels.activation import silu_and_mul
from fxrewrite.kernels.fp8_dispatch import fp8_linear_dispatch
from fxrewrite.kernels.fp8_tune import graph_time_us, release_cached_memory
from fxrewrite.kernels.rms_norm import rms_norm
from fxrewrite.kernels.skinny_gemv import GEMV_MAX_M, configs_for
from fxrewrite.kernels.skinny_gemv_fp8 import skinny_gemv_fp8_ref

__all__ = ["TOLERANCE", "BUCKETS", "make_inputs", "scratch_weights", "scratch_scales", "max_rel_error", "baseline",
           "reference", "candidates", "candidate", "tune_shape", "tune"]

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


def baseline(kind: str, w: torch.Tensor, x: torch.Tensor, residual=None, norm_weight=None, w_scale=None,
             per_channel: bool = False, scale_rows: int = 1) -> torch.Tensor:
    """The unfused kernels + cuBLAS (FP8 w with w_scale: + the chosen FP8 GEMM, told that w_scale's rows are
    equal in aligned runs of `scale_rows`) for one call of `kind` (what runs when the GEMV is not chosen)."""
    if kind == "silu":
        x = silu_and_mul(x)
    elif kind == "norm":
        x = rms_norm(x, norm_weight, 1e-6, residual)[0]
    if w_scale is not None:
        return fp8_linear_dispatch(x, w, w_scale, per_channel=per_channel, scale_rows=scale_rows)
    return F.linear(x, w)


def _candidate_set() -> str:
    """FXREWRITE_GEMV_CANDIDATES (same-machine baselines for benchmarks): "all" (default); "separate-prologue"
    (no "pipelined-fused" configs, as before they were written); "skinny" (the skinny GEMV's fused configs only, as
    before the tagged backends). ValueError for another value."""
    return env_choice("FXREWRITE_GEMV_CANDIDATES", "all", ("all", "separate-prologue", "skinny"))


def candidates(bucket: int, kind: str, n: int, fmt: str = "float") -> tuple[tuple, ...]:
    """What the tuner times for a bucket: the skinny GEMV's `configs_for(bucket, kind, n, fmt)`, then at one
    token on float weights the pipelined GEMV's tagged configs (`gemv_dispatch.pipelined_configs`) and, for "norm" /
    "silu", its prologue-in-the-loop form (`gemv_dispatch.fused_pipelined_configs`) and the prologue's kernel before
    the plain skinny GEMV (`gemv_dispatch.unfused_configs`)."""
    chosen = _candidate_set()
    if bucket != 1 or fmt != "float" or chosen == "skinny":
        return tuple(configs_for(bucket, kind, n, fmt=fmt))
    fused = gemv_dispatch.fused_pipelined_configs(kind) if chosen == "all" else ()
    return (tuple(configs_for(bucket, kind, n, fmt=fmt)) + gemv_dispatch.pipelined_configs() + fused
            + gemv_dispatch.unfused_configs(kind, n))


def candidate(kind: str, w: torch.Tensor, x: torch.Tensor, config, residual=None, norm_weight=None, w_scale=None,
              per_channel: bool = False) -> torch.Tensor:
    """The GEMV `config` names (skinny, or tagged pipelined: `gemv_dispatch.run`) for one call of `kind` (FP8 w:
    with w_scale, per_channel)."""
    fp8 = {"w_scale": w_scale, "per_channel": per_channel} if w_scale is not None else {}
    out = gemv_dispatch.run(x, w, None, config, norm_weight=norm_weight, eps=1e-6, residual=residual,
                            silu_mul=kind == "silu", **fp8)
    return out[0] if kind == "norm" else out


def reference(kind: str, w: torch.Tensor, x: torch.Tensor, residual=None, norm_weight=None, w_scale=None,
               per_channel: bool = False) -> torch.Tensor:
    """What a config must match: the baseline, or for FP8 weights the dequantized float32 product."""
    if w_scale is None:
        return baseline(kind, w, x, residual, norm_weight)
    out = skinny_gemv_fp8_ref(x, w, w_scale, per_channel=per_channel, norm_weight=norm_weight, eps=1e-6,
                              residual=residual, silu_mul=kind == "silu")
    return out[0] if kind == "norm" else out


def max_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def _proven(kind: str, w: torch.Tensor, bucket: int, config, dtype: torch.dtype, fp8: dict) -> None:
    """Raise unless `config` matches the reference at the bucket's smallest and largest token count."""
    for m in sorted({bucket // 2 + 1, bucket}):
        args = make_inputs(kind, m, w.shape[1], w.device, dtype, seed=m)
        err = max_rel_error(candidate(kind, w, config=config, **args, **fp8), reference(kind, w, **args, **fp8))
        if not err < TOLERANCE:
            raise ValueError(f"M={m}: max relative error {err:.3g} >= {TOLERANCE}")


def tune_shape(kind: str, ws: list[torch.Tensor], bucket: int, dtype: torch.dtype | None = None,
               fmt: str = "float", scale_rows: int = 1) -> dict[str, float | str]:
    """{"cublas" | "block_n/block_k/warps" | "pipelined/block_n/block_k/stages/warps": us per call, or "error: ..."}
    for one bucket of weights `ws` of format `fmt` (FP8: block_n/block_g/warps; activations in `dtype`, default
    the weights'; block-scaled: scales shared by aligned runs of `scale_rows` rows, as the layers'), every config
    of `candidates`; records the choice in gemv_dispatch."""
    n, k = ws[0].shape
    dtype = dtype or ws[0].dtype
    fp8 = {} if fmt == "float" else {"w_scale": scratch_scales(n, k, ws[0].device, fmt == "fp8-channel", scale_rows),
                                     "per_channel": fmt == "fp8-channel"}
    args = make_inputs(kind, bucket, k, ws[0].device, dtype)
    rows = {"scale_rows": scale_rows} if fp8 else {}
    results: dict[str, float | str] = {
        "cublas": graph_time_us(lambda i: baseline(kind, ws[i], **args, **fp8, **rows), 20, len(ws))}
    best = None
    for config in candidates(bucket, kind, n, fmt):
        name = "/".join(map(str, config))
        try:
            _proven(kind, ws[0], bucket, config, dtype, fp8)
            results[name] = graph_time_us(lambda i, c=config: candidate(kind, ws[i], config=c, **args, **fp8), 20,
                                          len(ws))
        except Exception as e:  # noqa: BLE001 - a config that fails or is wrong here is never chosen
            results[name] = f"error: {type(e).__name__}: {str(e)[:200]}"
            continue
        if results[name] < results["cublas"] and (best is None or results[name] < results[best[0]]):
            best = (name, config)
    gemv_dispatch.record(kind, n, k, bucket, best[1] if best else None, fmt)
    return results


def scratch_weights(n: int, k: int, device, dtype) -> list[torch.Tensor]:
    """Random [n, k] weight copies, as many as overflow the L2 twice (at most 8); dtype float8_e4m3fn: FP8
    values of about the checkpoints' spread (|w| up to ~100 of 448), to be used with `scratch_scales`."""
    copies = max(1, min(8, -(-_L2_BYTES // (n * k * torch.tensor([], dtype=dtype).element_size()))))
    if dtype == torch.float8_e4m3fn:
        return [torch.randn(n, k, device=device).mul_(32).to(dtype) for _ in range(copies)]
    return [torch.randn(n, k, device=device, dtype=dtype).div_(k ** 0.5) for _ in range(copies)]


def scratch_scales(n: int, k: int, device, per_channel: bool = False, rows: int = 1) -> torch.Tensor:
    """Random float32 weight scales [n, ceil(k/128)] (per_channel: equal along a row; rows: equal in aligned runs
    of this many rows, as a block-scaled checkpoint's scales expanded along N) stored as the FP8 layers store them
    on the GPU (strides (1, n))."""
    groups = -(-k // 128)
    s = torch.rand(1 if per_channel else groups, -(-n // rows), device=device).add_(0.5).div_(32 * k ** 0.5)
    s = s.repeat_interleave(rows, dim=1)[:, :n]
    return s.expand(groups, n).contiguous().t()


def tune(shapes: set[tuple], device, dtype: torch.dtype, max_m: int = GEMV_MAX_M) -> dict:
    """Measure every (kind, N, K), (kind, N, K, weight format) or (kind, N, K, weight format, scale rows) in
    `shapes` at each bucket <= min(max_m, GEMV_MAX_M) (the decode batch sizes the engine will run; activations in
    `dtype`) and record the choices. Returns {"kind NxK@bucket" (+ " fp8" / " fp8-channel", + " rows=R" for scale
    rows above 1): {name: us or error}}.
    No-op ({}) unless FXREWRITE_GEMV is "auto" and `device` is CUDA. FXREWRITE_GEMV_TUNE_LOG=path appends
    one JSON line of choices and timings."""
    if gemv_dispatch.mode() != "auto" or torch.device(device).type != "cuda":
        return {}
    buckets = [b for b in BUCKETS if b <= max(1, max_m)]
    timings = {}
    for shape in sorted(shapes, key=str):
        kind, n, k = shape[:3]
        fmt = shape[3] if len(shape) > 3 else "float"
        rows = shape[4] if len(shape) > 4 else 1
        release_cached_memory()  # the captures below need device memory the cache holds
        try:
            ws = scratch_weights(n, k, device, dtype if fmt == "float" else torch.float8_e4m3fn)
        except torch.cuda.OutOfMemoryError:  # no room for a scratch copy: this shape keeps cuBLAS
            logger.warning("skinny GEMV: no memory to time %s %dx%d; it keeps cuBLAS", kind, n, k)
            continue
        for b in buckets:
            release_cached_memory()  # the scratch's temporaries, the last bucket's graph pools
            key = f"{kind} {n}x{k}@{b}" + ("" if fmt == "float" else f" {fmt}") + (f" rows={rows}" if rows > 1 else "")
            timings[key] = tune_shape(kind, ws, b, dtype, fmt, rows)
        del ws
    torch.cuda.empty_cache()  # the scratch weights must not count as used when the KV cache is sized
    logger.info("skinny GEMV choices: %s", gemv_dispatch.choices())
    if os.environ.get("FXREWRITE_GEMV_TUNE_LOG"):
        with open(os.environ["FXREWRITE_GEMV_TUNE_LOG"], "a") as f:
            f.write(json.dumps({"choices": gemv_dispatch.choices(), "timings_us": timings}) + "\n")
    return timings
