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
under torch.compile, no autograd recording, M <= GEMV_MAX_M, weight and input of one float dtype
(bf16 / fp16 / fp32; FP8 weights have their own GEMV), weight contiguous.
"""

from __future__ import annotations

import os

import torch

from fxrewrite.kernels import use_triton
from fxrewrite.kernels.batch_invariant import is_batch_invariant
from fxrewrite.kernels.skinny_gemv import GEMV_MAX_M, configs_for
from fxrewrite.kernels.triton_utils import next_power_of_2

__all__ = ["KINDS", "mode", "choose", "config_for_call", "record", "choices", "clear"]

KINDS = ("linear", "norm", "silu")
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_choices: dict[tuple[str, int, int, int], tuple[int, int, int] | None] = {}


def mode() -> str:
    """``FXREWRITE_GEMV``: "auto" (default), "on" or "off"; ValueError naming any other value."""
    value = os.environ.get("FXREWRITE_GEMV", "auto")
    if value not in ("auto", "on", "off"):
        raise ValueError(f"FXREWRITE_GEMV={value!r}; expected 'auto', 'on' or 'off'")
    return value


def choose(kind: str, n: int, k: int, m: int) -> tuple[int, int, int] | None:
    """The (block_n, block_k, num_warps) config to run for m tokens, or None: cuBLAS (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"GEMV kind {kind!r}; expected one of {KINDS}")
    current = mode()
    if current == "off" or not 1 <= m <= GEMV_MAX_M:
        return None
    key = (kind, n, k, next_power_of_2(m))
    if current == "on" and key not in _choices:
        return configs_for(m)[0]
    return _choices.get(key)


def config_for_call(kind: str, x: torch.Tensor, w: torch.Tensor, *tensors: torch.Tensor | None):
    """`choose` for a call on x [..., K] (or [..., 2K] for "silu") and w [N, K]: None when the call is not
    eligible (module docstring); `tensors` (bias, norm weight, residual) must then also need no gradient."""
    if torch.compiler.is_compiling():
        return None  # first: a token-count test below would be a shape guard (a second compiled graph)
    k = x.shape[-1]
    if k == 0 or x.numel() > GEMV_MAX_M * k or not _choices and mode() != "on":
        return None  # the common exits next: prefill-sized calls, and nothing tuned (every eager step calls this)
    if not use_triton(x) or w.dim() != 2 or w.dtype != x.dtype or x.dtype not in _FLOATS:
        return None
    if is_batch_invariant():  # a token-count-dependent kernel choice would change the rows' sums
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, *tensors)):
        return None
    if not w.is_contiguous() or x.stride(-1) != 1:
        return None
    return choose(kind, w.shape[0], w.shape[1], x.numel() // x.shape[-1])


def record(kind: str, n: int, k: int, bucket: int, config: tuple[int, int, int] | None) -> None:
    """Store the measured choice for (kind, N, K, bucket): a config, or None (cuBLAS won)."""
    if kind not in KINDS or bucket not in (1, 2, 4, 8) or bucket > GEMV_MAX_M:
        raise ValueError(f"record: kind {kind!r} / bucket {bucket} not in {KINDS} / (1, 2, 4, 8)")
    _choices[(kind, n, k, bucket)] = tuple(config) if config is not None else None


def choices() -> dict[str, str]:
    """{"kind NxK @bucket": "block_n/block_k/warps" or "cublas"} of every tuned bucket (for logs and JSON)."""
    return {f"{kind} {n}x{k}@{b}": "/".join(map(str, cfg)) if cfg else "cublas"
            for (kind, n, k, b), cfg in sorted(_choices.items())}


def clear() -> None:
    """Forget every measured choice (tests)."""
    _choices.clear()
