"""Load-time choice of the FP8 backend per (N, K, token bucket) (`fxrewrite.kernels.fp8_dispatch`),
measured and proven on the device before the engine captures its decode CUDA graphs.

For every candidate backend of a bucket (fp8_dispatch's names), fastest first by graph-replay time:

1. time it: a CUDA graph of `reps` calls of the whole layer product (activation quantization
   included) over enough copies of the weight to overflow the 50 MB L2 (so the weight streams from
   HBM as in a model, where each layer's weight is read once per step), replayed and timed with CUDA
   events. Graph replay is what decode runs, so Python launch overhead, which dominated the first
   eager timings (tens of microseconds per call at M = 1), is not measured;
2. prove it at every token count of the bucket that the engine's decode graphs use (`GRAPH_SIZES`,
   mirroring runtime/worker/cuda_graphs.capture_sizes up to 512) plus the bucket's smallest and
   smallest odd count: run eagerly, compare with the float32 reference (max error relative to the
   largest output < `TOLERANCE`: FP8 rounding is ~3 %, a wrong scale layout is ~100 %), and up to 512
   tokens capture it in a throwaway CUDA graph, replay and compare with the eager output.

A candidate that raises anywhere (cuBLASLt's CUBLAS_STATUS_NOT_SUPPORTED at some M, a scale layout
torch refuses) or misses the tolerance is dropped; the bucket keeps its passing candidates, fastest
first, for `fp8_dispatch`'s demotion (whose last resort is the Triton GEMM).

Shapes whose layers have per-channel weight scales (``quantization="fp8"`` on a bf16 checkpoint) are
tuned apart, with per-channel scratch scales, and only they get the ``scaled_mm_rowwise`` and
``triton_rowwise:<i>`` candidates. Block-scaled shapes are timed on scratch scales of one per 128 x 128 block,
passed with ``scale_rows=128`` (the pipelined GEMV's shared-scale form, what checkpoint layers whose parts start
on 16-row boundaries run; a layer that does not runs its per-element form, correct but not what was timed).
"""

from __future__ import annotations

import json
import logging
import os

import torch

from fxrewrite.kernels import fp8_dispatch
from fxrewrite.kernels.fp8_dispatch import BUCKETS, fp8_linear_dispatch
from fxrewrite.kernels.fp8_gemm import ALT_CONFIGS, config_for
from fxrewrite.kernels.fp8_gemv import GEMV_CONFIGS, GEMV_MAX_M
from fxrewrite.kernels.fp8_gemv_pipelined import PIPELINED_CONFIGS
from fxrewrite.kernels.fp8_rowwise import ROWWISE_CONFIGS, ROWWISE_MAX_M
from fxrewrite.kernels.fp8_scaled_mm import scaled_mm_supported_shape

__all__ = ["GRAPH_SIZES", "TOLERANCE", "candidates", "sizes_to_prove", "capture", "graph_time_us",
           "release_cached_memory", "tune"]

logger = logging.getLogger(__name__)

GRAPH_SIZES = (1, 2, 4, 8, *range(16, 513, 16))
TOLERANCE = 0.1
_L2_BYTES = 128 << 20  # weight copies per timing graph: > 2x the H200's 50 MB L2
_BLOCK_ROWS = 128  # rows per scale block of the block-scaled scratch weights (checkpoints' weight_block_size[0])


def candidates(n: int, k: int, m: int, per_channel: bool = False) -> list[str]:
    """Backend names worth timing for an [m, k] x [n, k]^T product (per_channel: the weight has one
    scale per output row, which ``scaled_mm_rowwise`` and ``triton_rowwise:<i>`` need)."""
    names = [f"gemv:{i}" for i in range(len(GEMV_CONFIGS))] if m <= GEMV_MAX_M else []
    if m == 1:
        names += [f"{fp8_dispatch.PIPELINED}:{i}" for i in range(len(PIPELINED_CONFIGS))]
    names.append("triton")
    if m > 64:
        names += [f"triton:{i}" for i, cfg in enumerate(ALT_CONFIGS) if cfg != config_for(m)]
    if scaled_mm_supported_shape(n, k):
        names.append("scaled_mm")
        if per_channel:
            names.append(fp8_dispatch.ROWWISE)
    if per_channel and 16 < m <= ROWWISE_MAX_M:
        names += [f"{fp8_dispatch.TRITON_ROWWISE}:{i}" for i in range(len(ROWWISE_CONFIGS))]
    return names


def sizes_to_prove(bucket: int) -> list[int]:
    """Token counts a bucket's backend must pass: the graph sizes in it, its bound, its smallest count
    and its smallest odd count."""
    low = max((b for b in BUCKETS if b < bucket), default=0) + 1
    odd = low if low % 2 else low + 1
    return sorted({s for s in GRAPH_SIZES if low <= s <= bucket} | {low, min(odd, bucket), bucket})


_streams: dict[int, torch.cuda.Stream] = {}


def _capture_stream() -> torch.cuda.Stream:
    """One side stream per device for every capture (as torch.cuda.graph keeps one): each new stream
    would get its own cuBLAS workspace."""
    device = torch.cuda.current_device()
    if device not in _streams:
        _streams[device] = torch.cuda.Stream()
    return _streams[device]


def capture(fn) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, fn's result) of `fn()` captured on a side stream. Unlike ``torch.cuda.graph`` this runs no
    ``gc.collect()`` per capture (tens of milliseconds with a large model loaded; the tuner captures
    hundreds of graphs); the caller warms `fn` up first."""
    graph, stream = torch.cuda.CUDAGraph(), _capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            out = fn()
        except BaseException:
            try:
                graph.capture_end()
            except Exception:  # noqa: BLE001 - the capture was invalidated; fn's error is the one to report
                pass
            raise
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out


def release_cached_memory() -> None:
    """Hand the caching allocator's free blocks back to the driver before capturing: a CUDA graph's private pool takes
    fresh device memory, and the allocator cannot release cached blocks while a capture is under way. Without this,
    Qwen3-32B block-FP8 on an 80 GB H100 (dummy weights: the bf16 ones quantized away, then each shape's float32
    scratch, all left cached) had 2 MiB free at the gate_up shape: every candidate's capture ran out of memory and
    the shape was left untuned (2026-12-05-fp8-tune-32b-h100-forty-second.jsonl)."""
    torch.cuda.empty_cache()


def graph_time_us(fn, reps: int, copies: int = 1) -> float:
    """Microseconds per call of `fn(i)` (i: copy index, cycled) replayed from one CUDA graph."""
    for i in range(copies):
        fn(i)  # compile / warm up outside the capture
    torch.cuda.synchronize()

    def calls():
        out = None
        for r in range(reps):
            out = fn(r % copies)  # one output alive at a time: the pool reuses the others' memory
        return out

    graph, _ = capture(calls)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (3 * reps)


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _prove(name: str, w: torch.Tensor, w_s: torch.Tensor, wf: torch.Tensor, m: int, dtype: torch.dtype,
           per_channel: bool = False) -> None:
    """Raise unless `name` is right at m tokens, eagerly and (m <= 512) replayed from a CUDA graph."""
    x = torch.randn(m, w.shape[1], device=w.device, dtype=dtype)
    rows = min(m, 64)  # rows are independent: check a slice against the reference
    rows_shared = 1 if per_channel else _BLOCK_ROWS
    eager = fp8_linear_dispatch(x, w, w_s, backend=name, per_channel=per_channel, scale_rows=rows_shared)
    err = _max_rel(eager[:rows], x[:rows].float() @ wf.t())
    if not err < TOLERANCE:
        raise ValueError(f"max relative error {err:.3g} >= {TOLERANCE}")
    if m > GRAPH_SIZES[-1]:
        return
    torch.cuda.synchronize()
    graph, out = capture(lambda: fp8_linear_dispatch(x, w, w_s, backend=name, per_channel=per_channel,
                                                     scale_rows=rows_shared))
    graph.replay()
    torch.cuda.synchronize()
    err = _max_rel(out, eager.float())
    del graph
    if not err < 1e-2:
        raise ValueError(f"graph replay differs from the eager call (max relative error {err:.3g})")


def _scratch(n: int, k: int, device, per_channel: bool = False) -> tuple[list[torch.Tensor], torch.Tensor,
                                                                         torch.Tensor]:
    """Random FP8 weight copies [N, K] (enough to overflow L2), per-row scales with strides (1, N) (per_channel:
    every group of a row the same; else one per 128 x 128 block, as checkpoints), and the dequantized float32
    weight of copy 0."""
    copies = max(1, min(8, -(-_L2_BYTES // (n * k))))
    ws = [torch.randn(n, k, device=device).div_(8).to(torch.float8_e4m3fn) for _ in range(copies)]
    groups, blocks = -(-k // 128), -(-n // _BLOCK_ROWS)
    w_s = torch.rand(1 if per_channel else groups, n if per_channel else blocks, device=device,
                     dtype=torch.float32).add_(0.5).div_(448)
    w_s = w_s.expand(groups, n) if per_channel else w_s.repeat_interleave(_BLOCK_ROWS, dim=1)[:, :n]
    w_s = w_s.contiguous().t()
    wf = ws[0].float().mul_(w_s.repeat_interleave(128, dim=1)[:, :k])
    return ws, w_s, wf


def _tune_bucket(ws, w_s, wf, bucket: int, dtype: torch.dtype, per_channel: bool = False) -> dict[str, float | str]:
    """{backend: us per call, or "error: ..."} for one bucket; records the passing ones in fp8_dispatch."""
    n, k = ws[0].shape
    x = torch.randn(bucket, k, device=ws[0].device, dtype=dtype)
    reps = 20 if bucket <= 256 else 5
    results: dict[str, float | str] = {}
    for name in candidates(n, k, bucket, per_channel):
        try:
            results[name] = graph_time_us(lambda i, name=name: fp8_linear_dispatch(
                x, ws[i], w_s, backend=name, per_channel=per_channel, scale_rows=1 if per_channel else _BLOCK_ROWS),
                reps, len(ws))
        except Exception as e:  # noqa: BLE001 - a backend this GPU / torch / M cannot run is no candidate
            results[name] = f"error: {type(e).__name__}: {str(e)[:200]}"
    timed = sorted((t, name) for name, t in results.items() if isinstance(t, float))
    passed = []
    for _, name in timed:
        try:
            for m in sizes_to_prove(bucket):
                _prove(name, ws[0], w_s, wf, m, dtype, per_channel)
            passed.append(name)
        except Exception as e:  # noqa: BLE001 - failed proof: never chosen
            results[name] = f"error at M={m}: {type(e).__name__}: {str(e)[:200]}"
            logger.info("FP8 backend %s refused for N=%d K=%d bucket %d: %s", name, n, k, bucket, results[name])
    fp8_dispatch.record(n, k, bucket, passed, per_channel)
    return results


def tune(shapes: set[tuple], device: torch.device, out_dtype: torch.dtype = torch.bfloat16,
         buckets: tuple[int, ...] = BUCKETS) -> dict[tuple[int, int, int], dict[str, float | str]]:
    """Measure and prove every candidate for each (N, K) or (N, K, per_channel) in `shapes` at each of
    `buckets` (see the module docstring); record the choices in fp8_dispatch. Returns
    {(N, K, bucket): {backend: us or error}} (per-channel shapes: (N, K, bucket, True)).
    No-op (returns {}) unless FXREWRITE_FP8_GEMM is auto and `device` is CUDA."""
    if fp8_dispatch._forced() != "auto" or torch.device(device).type != "cuda":
        return {}
    timings = {}
    for shape in sorted(shapes):
        n, k, per_channel = shape[0], shape[1], bool(shape[2:] and shape[2])
        release_cached_memory()  # else the scratch is carved out of cached segments, which then cannot be released
        ws, w_s, wf = _scratch(n, k, device, per_channel)
        for b in buckets:
            release_cached_memory()  # the scratch's temporaries, the last bucket's graph pools
            key = (n, k, b, True) if per_channel else (n, k, b)
            timings[key] = _tune_bucket(ws, w_s, wf, b, out_dtype, per_channel)
        del ws, w_s, wf
    torch.cuda.empty_cache()  # the scratch tensors must not count as used when the KV cache is sized
    logger.info("FP8 GEMM backends: %s", fp8_dispatch.choices())
    if os.environ.get("FXREWRITE_FP8_TUNE_LOG"):  # one JSON line per tuning: GPU scripts keep it
        with open(os.environ["FXREWRITE_FP8_TUNE_LOG"], "a") as f:
            f.write(json.dumps({"choices": fp8_dispatch.choices(),
                                "timings_us": {f"{key[0]}x{key[1]}@{key[2]}" + ("/channel" if key[3:] else ""): t
                                               for key, t in timings.items()}}) + "\n")
    return timings
