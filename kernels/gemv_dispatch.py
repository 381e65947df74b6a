"""Where the skinny GEMV (`fxrewrite.kernels.skinny_gemv`) runs instead of cuBLAS, and running it.

A call is described by its kind: ``"linear"`` (x @ w^T + b), ``"norm"`` (RMSNorm of x, after the
residual add when there is one, fused as the GEMV's prologue) or ``"silu"`` (silu(gate) * up of a
gate_up output fused as the prologue), its weight's (N, K), and its token bucket (the power of two
>= M, M <= GEMV_MAX_M). ``FXREWRITE_GEMV`` decides:

- ``auto`` (default): the GEMV runs only for the (kind, N, K, bucket) where the load-time timing
  (`fxrewrite.kernels.gemv_tune.tune`, called when a model is loaded on a GPU) measured it faster than
  the unfused kernels plus cuBLAS, with the config it measured fastest; untuned shapes keep cuBLAS;
- ``on``: every eligible call runs it, with the first candidate config, except where a choice was recorded
  (tests compare this; the load-time timing does not run);
- ``off``: never.

Eligible: a Triton-capable input (CUDA, or the CPU interpreter when forced, see `use_triton`), not
under torch.compile, no autograd recording, M <= GEMV_MAX_M, weight contiguous, and either weight and
input of one float dtype (bf16 / fp16 / fp32), or a float8_e4m3fn weight with its float32 scales
[N, ceil(K/128)] (`fxrewrite.kernels.skinny_gemv_fp8`; weight format "fp8", or "fp8-channel" for one
scale per row). Choices are kept per weight format, so an FP8 layer and a bf16 layer of one shape are
tuned apart.
"""

from __future__ import annotations

import os

import torch

from fxrewrite.kernels import use_triton
from fxrewrite.kernels.batch_invariant import is_batch_invariant
from fxrewrite.kernels.skinny_gemv import FORMATS, GEMV_MAX_M, configs_for, skinny_gemv_triton
from fxrewrite.kernels.skinny_gemv_fp8 import skinny_gemv_fp8_triton
from fxrewrite.kernels.triton_utils import next_power_of_2

__all__ = ["KINDS", "mode", "choose", "config_for_call", "weight_format", "run", "record", "choices", "clear"]

KINDS = ("linear", "norm", "silu")
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_FP8 = torch.float8_e4m3fn
_choices: dict[tuple[str, int, int, int, str], tuple[int, int, int] | None] = {}


def mode() -> str:
    """``FXREWRITE_GEMV``: "auto" (default), "on" or "off"; ValueError naming any other value."""
    value = os.environ.get("FXREWRITE_GEMV", "auto")
    if value not in ("auto", "on", "off"):
        raise ValueError(f"FXREWRITE_GEMV={value!r}; expected 'auto', 'on' or 'off'")
    return value


def choose(kind: str, n: int, k: int, m: int, fmt: str = "float") -> tuple[int, int, int] | None:
    """The config to run for m tokens on a weight of format `fmt`, or None: cuBLAS / the FP8 GEMM (see the
    module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"GEMV kind {kind!r}; expected one of {KINDS}")
    current = mode()
    if current == "off" or not 1 <= m <= GEMV_MAX_M:
        return None
    key = (kind, n, k, next_power_of_2(m), fmt)
    if current == "on" and key not in _choices:
        return configs_for(m, kind, n, fmt=fmt)[0]
    return _choices.get(key)


def weight_format(w: torch.Tensor, w_scale: torch.Tensor | None = None, per_channel: bool = False) -> str | None:
    """`FORMATS` entry of a weight (None: not a GEMV weight, e.g. FP8 without its scales)."""
    if w.dtype == _FP8:
        return None if w_scale is None else ("fp8-channel" if per_channel else "fp8")
    return "float" if w.dtype in _FLOATS else None


def config_for_call(kind: str, x: torch.Tensor, w: torch.Tensor, *tensors: torch.Tensor | None,
                    w_scale: torch.Tensor | None = None, per_channel: bool = False):
    """`choose` for a call on x [..., K] (or [..., 2K] for "silu") and w [N, K] (FP8: with w_scale): None
    when the call is not eligible (module docstring); `tensors` (bias, norm weight, residual) must then also
    need no gradient."""
    if torch.compiler.is_compiling():
        return None  # first: a token-count test below would be a shape guard (a second compiled graph)
    k = x.shape[-1]
    if k == 0 or x.numel() > GEMV_MAX_M * k or not _choices and mode() != "on":
        return None  # the common exits next: prefill-sized calls, and nothing tuned (every eager step calls this)
    fmt = weight_format(w, w_scale, per_channel)
    if not use_triton(x) or w.dim() != 2 or fmt is None or x.dtype not in _FLOATS:
        return None
    if fmt == "float" and w.dtype != x.dtype:
        return None
    if is_batch_invariant():  # a token-count-dependent kernel choice would change the rows' sums
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, *tensors)):
        return None
    if not w.is_contiguous() or x.stride(-1) != 1:
        return None
    return choose(kind, w.shape[0], w.shape[1], x.numel() // x.shape[-1], fmt)


def run(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, config, w_scale: torch.Tensor | None = None,
        per_channel: bool = False, **prologue):
    """The skinny GEMV of the weight's format: `skinny_gemv_triton`, or `skinny_gemv_fp8_triton` for an FP8
    weight (w_scale [N, ceil(K/128)]); x [M, K] (or [M, 2K]); `prologue`: norm_weight, eps, residual, silu_mul."""
    if w.dtype == _FP8:
        return skinny_gemv_fp8_triton(x, w, w_scale, bias, per_channel=per_channel, config=config, **prologue)
    return skinny_gemv_triton(x, w, bias, config=config, **prologue)


def record(kind: str, n: int, k: int, bucket: int, config: tuple[int, int, int] | None, fmt: str = "float") -> None:
    """Store the measured choice for (kind, N, K, bucket, weight format): a config, or None (cuBLAS won)."""
    if kind not in KINDS or bucket not in (1, 2, 4, 8) or bucket > GEMV_MAX_M or fmt not in FORMATS:
        raise ValueError(f"record: kind {kind!r} / bucket {bucket} / format {fmt!r} not in {KINDS} / (1, 2, 4, 8) "
                         f"/ {FORMATS}")
    _choices[(kind, n, k, bucket, fmt)] = tuple(config) if config is not None else None


def choices() -> dict[str, str]:
    """{"kind NxK@bucket" (+ " fp8" / " fp8-channel"): "block_n/block_k/warps" (FP8: block_n/block_g/warps)
    or "cublas"} of every tuned bucket (for logs and JSON)."""
    return {f"{kind} {n}x{k}@{b}" + ("" if fmt == "float" else f" {fmt}"): "/".join(map(str, cfg)) if cfg
            else "cublas" for (kind, n, k, b, fmt), cfg in sorted(_choices.items())}


def clear() -> None:
    """Forget every measured choice (tests)."""
    _choices.clear()
