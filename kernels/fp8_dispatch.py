"""Which block-scaled FP8 product runs for a layer's (N, K) at a token count M, and running it.

Backends (names are what `choose` returns and `fxrewrite.kernels.fp8_tune` measures):

- ``"gemv:<i>"``: the weight-only matrix-vector kernel (fp8_gemv.py) with `GEMV_CONFIGS[i]`, on the
  unquantized activations (no quantization kernel runs), M <= GEMV_MAX_M;
- ``"gemv_pipelined:<i>"``: the weight-only one-token kernel with a software-pipelined weight stream
  (fp8_gemv_pipelined.py) with `PIPELINED_CONFIGS[i]`, M = 1 only (the bucket of batch-1 decode);
- ``"triton"`` / ``"triton:<i>"``: per-token-group activation quantization, then the tiled Triton GEMM
  with its default tile table / `ALT_CONFIGS[i]`;
- ``"scaled_mm"``: the same quantization, then torch's block-scaled matmul (cuBLASLt, fp8_scaled_mm.py);
- ``"scaled_mm_rowwise"``: per-channel weights only (``quantization="fp8"`` on a bf16 checkpoint):
  per-token activation quantization, then torch's row-wise scaled matmul (fp8_rowwise.py);
- ``"triton_rowwise:<i>"``: per-channel weights only: the same quantization, then the Triton row-wise
  GEMM (fp8_rowwise.py) with `ROWWISE_CONFIGS[i]`.

A token count maps to the smallest bucket holding it (above 8192: the 8192 bucket). The choice per
(N, K, bucket, per-channel or not) is made on the device when an FP8 model is loaded (`fp8_tune.tune`): every candidate is
run, checked against the reference and captured in a CUDA graph at each token count of the bucket that
the engine's decode graphs use, and timed by graph replay; the fastest that passed wins. Untuned, M <=
GEMV_MAX_M runs ``gemv:0`` and larger M ``triton``. ``FXREWRITE_FP8_GEMM=triton`` or ``=scaled_mm``
forces one GEMM backend (``auto``, the default, chooses).

Safety net: should the chosen backend still raise (say cuBLASLt at a token count the tuner did not
see), the bucket is demoted to its next validated backend, finally the Triton GEMM (a warning names
it), and outside a CUDA-graph capture the call is rerun there; inside a capture the error propagates,
so the engine retries that one graph's capture after a fresh eager warm-up (which takes the fallback).

The weight scales are per row, [N, ceil(K/128)], stored outer-dim major (strides (1, N)): the layout
scaled_mm's ``BlockWise1x128`` takes for the weight, which the Triton kernels read as well.
"""

from __future__ import annotations

import logging

import torch

from fxrewrite.kernels import env_choice, use_triton
from fxrewrite.kernels.fp8_gemm import ALT_CONFIGS, fp8_block_gemm_triton, fp8_linear, per_token_group_quant_fp8
from fxrewrite.kernels.fp8_gemv import GEMV_CONFIGS, GEMV_MAX_M, fp8_block_gemv_triton
from fxrewrite.kernels.fp8_gemv_pipelined import PIPELINED_CONFIGS, fp8_gemv_pipelined_triton
from fxrewrite.kernels.fp8_rowwise import (ROWWISE_CONFIGS, channel_scales, fp8_rowwise_gemm_triton,
                                           fp8_scaled_mm_rowwise, per_token_quant_fp8)
from fxrewrite.kernels.fp8_scaled_mm import fp8_scaled_mm

__all__ = ["BUCKETS", "bucket_of", "choose", "fp8_gemm_dispatch", "fp8_linear_dispatch", "input_quantization",
           "run_quantized", "record", "choices", "clear", "ROWWISE", "TRITON_ROWWISE", "PIPELINED", "per_channel_only",
           "weight_only"]

logger = logging.getLogger(__name__)

ROWWISE = "scaled_mm_rowwise"
TRITON_ROWWISE = "triton_rowwise"
PIPELINED = "gemv_pipelined"
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_choices: dict[tuple[int, int, int, bool], str] = {}
_ranked: dict[tuple[int, int, int, bool], list[str]] = {}
"""(N, K, bucket, per_channel) -> the validated backends, fastest first (the demotion order)."""


def per_channel_only(backend: str) -> bool:
    """Whether `backend` reads one weight scale per output row (per-token activation scales)."""
    return backend == ROWWISE or backend.startswith(TRITON_ROWWISE + ":")


def weight_only(backend: str, m: int) -> bool:
    """Whether `backend` runs on the unquantized activations of an m-token product (a GEMV within its token
    limit: ``gemv:<i>`` up to GEMV_MAX_M, ``gemv_pipelined:<i>`` at one token)."""
    if backend.startswith(PIPELINED + ":"):
        return m == 1
    return backend.startswith("gemv:") and m <= GEMV_MAX_M


def bucket_of(m: int) -> int:
    return next((b for b in BUCKETS if m <= b), BUCKETS[-1])


def _forced() -> str:
    return env_choice("FXREWRITE_FP8_GEMM", "auto", ("auto", "triton", "scaled_mm"))


def default_backend(m: int) -> str:
    """The backend of an untuned bucket."""
    return "gemv:0" if m <= GEMV_MAX_M else "triton"


def choose(n: int, k: int, m: int, per_channel: bool = False) -> str:
    """The backend for an [m, k] x [n, k]^T product (see the module docstring); per_channel: the
    weight scales are one per output row (then ``scaled_mm_rowwise`` may have been chosen)."""
    forced = _forced()
    if forced != "auto":
        return forced
    return _choices.get((n, k, bucket_of(m), per_channel), default_backend(m))


def record(n: int, k: int, bucket: int, ranked: list[str], per_channel: bool = False) -> None:
    """Store the tuner's validated backends for (n, k, bucket), fastest first (an empty list: untuned).
    ValueError for a per-channel-only backend (`per_channel_only`) on weights that are not per-channel."""
    if not per_channel and any(map(per_channel_only, ranked)):
        raise ValueError(f"{[b for b in ranked if per_channel_only(b)]} need per-channel weight scales; got them "
                         f"for block-scaled N={n} K={k}")
    if ranked:
        _ranked[(n, k, bucket, per_channel)] = list(ranked)
        _choices[(n, k, bucket, per_channel)] = ranked[0]


def choices() -> dict[str, str]:
    """{"N x K @ bucket": backend} of every tuned bucket (what benchmarks and logs report; a
    "/channel" suffix marks per-channel weights)."""
    return {f"{n}x{k}@{b}" + ("/channel" if pc else ""): name for (n, k, b, pc), name in sorted(_choices.items())}


def _demote(n: int, k: int, m: int, backend: str, error: Exception, per_channel: bool = False) -> None:
    key = (n, k, bucket_of(m), per_channel)
    ranked = [name for name in _ranked.get(key, [backend]) if name != backend] or ["triton"]
    _ranked[key], _choices[key] = ranked, ranked[0]
    logger.warning("FP8 GEMM %s failed for N=%d K=%d M=%d (%s: %s); bucket %d now runs %s",
                   backend, n, k, m, type(error).__name__, str(error)[:200], key[2], ranked[0])


def fp8_gemm_dispatch(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
                      out_dtype: torch.dtype, backend: str | None = None) -> torch.Tensor:
    """a [M, K] fp8, a_s [M, G] float32 (outer-dim major), w [N, K] fp8, w_s [N, G] float32 -> [M, N]
    (a "gemv:<i>" backend runs its W8A8 form here)."""
    backend = backend or choose(w.shape[0], w.shape[1], a.shape[0])
    if backend.startswith(PIPELINED + ":"):  # weight-only: no form for quantized activations
        backend = "triton"
    if backend == "scaled_mm":
        return fp8_scaled_mm(a, a_s, w, w_s, out_dtype, per_row=True)
    if backend.startswith("gemv:"):
        block_n, target, step = GEMV_CONFIGS[int(backend.split(":")[1])]
        return fp8_block_gemv_triton(a, a_s, w, w_s, out_dtype, block_n, target, step)
    config = ALT_CONFIGS[int(backend.split(":")[1])] if ":" in backend else None
    return fp8_block_gemm_triton(a, a_s, w, w_s, 128, out_dtype, config)


def _rowwise(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, out_dtype: torch.dtype,
             backend: str) -> torch.Tensor:
    if backend == ROWWISE:
        return fp8_scaled_mm_rowwise(q, s, w, channel_scales(w_s), out_dtype)
    config = ROWWISE_CONFIGS[int(backend.split(":")[1])]
    return fp8_rowwise_gemm_triton(q, s, w, channel_scales(w_s), out_dtype, config)


def _run(x2: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, backend: str, per_channel: bool,
         scale_rows: int = 1) -> torch.Tensor:
    if backend.startswith(PIPELINED + ":"):
        config = PIPELINED_CONFIGS[int(backend.split(":")[1])]
        return fp8_gemv_pipelined_triton(x2, w, w_s, config, per_channel, scale_rows)
    if per_channel_only(backend):
        q, s = per_token_quant_fp8(x2)
        return _rowwise(q, s, w, w_s, x2.dtype, backend)
    if backend.startswith("gemv:"):
        block_n, target, step = GEMV_CONFIGS[int(backend.split(":")[1])]
        return fp8_block_gemv_triton(x2, None, w, w_s, x2.dtype, block_n, target, step)
    q, s = per_token_group_quant_fp8(x2, 128, column_major_scales=True)
    return fp8_gemm_dispatch(q, s, w, w_s, x2.dtype, backend)


def input_quantization(n: int, k: int, m: int, per_channel: bool = False) -> tuple[str, int | None] | None:
    """(backend, activation group size: None per token, 128 per token group) when the backend chosen for an
    [m, k] x [n, k]^T product reads FP8 activations, which a producing kernel can then write directly
    (`fxrewrite.kernels.fp8_quant_fused`); None for the weight-only GEMV, which reads them unquantized."""
    backend = choose(n, k, m, per_channel)
    if weight_only(backend, m):
        return None
    if backend.startswith(("gemv:", PIPELINED + ":")):
        backend = "triton"
    return backend, (None if per_channel_only(backend) else 128)


def run_quantized(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, out_dtype: torch.dtype,
                  backend: str, per_channel: bool = False) -> torch.Tensor | None:
    """The GEMM of `input_quantization` on activations already quantized in its form: q [M, K] fp8, s [M, 1]
    (row-wise) or [M, ceil(K/128)] float32, outer-dim major -> [M, N] out_dtype. Should the backend raise,
    the bucket is demoted as in `fp8_linear_dispatch`; inside a CUDA-graph capture the error propagates,
    else None is returned (the caller runs the unfused path)."""
    try:
        if per_channel_only(backend):
            return _rowwise(q, s, w, w_s, out_dtype, backend)
        return fp8_gemm_dispatch(q, s, w, w_s, out_dtype, backend)
    except Exception as e:  # noqa: BLE001 - as fp8_linear_dispatch's safety net
        if backend == "triton" or _forced() != "auto":
            raise
        _demote(w.shape[0], w.shape[1], q.shape[0], backend, e, per_channel)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise
        return None


def fp8_linear_dispatch(x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, group_size: int = 128,
                        backend: str | None = None, per_channel: bool = False, scale_rows: int = 1) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype through `backend` (default: `choose`); the torch reference
    (`fxrewrite.kernels.fp8_gemm.fp8_linear`) on a CPU without the Triton interpreter and for scale
    groups other than 128. per_channel: every column of w_s is the same per-row scale (required by
    ``scaled_mm_rowwise`` and ``triton_rowwise:<i>``; ValueError otherwise). scale_rows: w_s's rows are
    equal in aligned runs of this many (block-scaled layers; `fp8_gemv_pipelined_triton` then scales x)."""
    if backend is not None and per_channel_only(backend) and not per_channel:
        raise ValueError(f"backend {backend!r} needs per-channel weight scales (per_channel=True)")
    if group_size != 128 or not use_triton(x):
        return fp8_linear(x, w, w_s, group_size)
    lead, (n, k) = x.shape[:-1], w.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    name = backend or choose(n, k, x2.shape[0], per_channel)
    if name.startswith(("gemv:", PIPELINED + ":")) and not weight_only(name, x2.shape[0]):
        name = "triton"
    try:
        out = _run(x2, w, w_s, name, per_channel, scale_rows)
    except Exception as e:  # noqa: BLE001 - any backend but the plain Triton GEMM falls back
        if backend is not None or name == "triton" or _forced() != "auto":
            raise
        _demote(n, k, x2.shape[0], name, e, per_channel)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise
        out = _run(x2, w, w_s, choose(n, k, x2.shape[0], per_channel), per_channel, scale_rows)
    return out.reshape(*lead, n)


def clear() -> None:
    """Forget every measured choice (tests)."""
    _choices.clear()
    _ranked.clear()
