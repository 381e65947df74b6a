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

A choice is a skinny GEMV config (block_n, block_k, num_warps[, split_k]) (FP8: (block_n, block_g, num_warps)),
or, for float weights at one token (bucket 1), a config tagged with its backend:
``("pipelined", block_n, block_k, num_stages, num_warps)`` (`fxrewrite.kernels.skinny_gemv_pipelined`: the
prologue's own kernel, then the pipelined GEMV), for "norm" / "silu" ``("pipelined-fused", block_n, block_k,
num_stages, num_warps)`` (the pipelined GEMV with the prologue inside its loop: one launch), or
``("unfused", block_n, block_k, num_warps[, split_k])`` for
"norm" / "silu" (the prologue's own kernel, then the skinny GEMV without a prologue: at Qwen3-32B's K = 5120 /
25600 the prologue recomputed by every program cost more than the separate launch, 2026-12-02 eighteenth tune
log). `run` dispatches on the tag; `choices` writes a config as its parts joined by "/" and `parse` reads that back.
"""

from __future__ import annotations


import torch

from fxrewrite.kernels import env_choice, use_triton
from fxrewrite.kernels.batch_invariant import is_batch_invariant
from fxrewrite.kernels.skinny_gemv import FORMATS, GEMV_MAX_M, configs_for, skinny_gemv_triton
from fxrewrite.kernels.skinny_gemv_fp8 import skinny_gemv_fp8_triton
from fxrewrite.kernels.skinny_gemv_pipelined import (PIPELINED_CONFIGS, skinny_gemv_pipelined,
                                                     skinny_gemv_pipelined_fused, with_prologue)
from fxrewrite.kernels.triton_utils import next_power_of_2

__all__ = ["KINDS", "PIPELINED", "PIPELINED_FUSED", "UNFUSED", "TAGS", "fused_pipelined_configs", "unfused_configs",
           "mode", "choose", "config_for_call", "weight_format", "pipelined_configs", "is_pipelined", "run", "record",
           "choices", "parse", "clear"]

KINDS = ("linear", "norm", "silu")
PIPELINED = "pipelined"
"""Tag of a choice that runs `skinny_gemv_pipelined` (float weights, one token)."""
PIPELINED_FUSED = "pipelined-fused"
"""Tag of a choice that runs `skinny_gemv_pipelined_fused` ("norm" / "silu", float weights, one token)."""
UNFUSED = "unfused"
"""Tag of a choice that runs the prologue's own kernel, then the skinny GEMV without one (float weights, one token)."""
TAGS = (PIPELINED, PIPELINED_FUSED, UNFUSED)
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_FP8 = torch.float8_e4m3fn
_choices: dict[tuple[str, int, int, int, str], tuple | None] = {}


def mode() -> str:
    """``FXREWRITE_GEMV``: "auto" (default), "on" or "off"; ValueError naming any other value."""
    return env_choice("FXREWRITE_GEMV", "auto", ("auto", "on", "off"))


def choose(kind: str, n: int, k: int, m: int, fmt: str = "float") -> tuple | None:
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


def pipelined_configs() -> tuple[tuple, ...]:
    """The pipelined GEMV's candidates as tagged choices: ("pipelined", *c) for c in `PIPELINED_CONFIGS`."""
    return tuple((PIPELINED, *c) for c in PIPELINED_CONFIGS)


def fused_pipelined_configs(kind: str) -> tuple[tuple, ...]:
    """For "norm" / "silu": ("pipelined-fused", *c) for c in `PIPELINED_CONFIGS`; for "linear" () (no prologue)."""
    return tuple((PIPELINED_FUSED, *c) for c in PIPELINED_CONFIGS) if kind != "linear" else ()


def unfused_configs(kind: str, n: int) -> tuple[tuple, ...]:
    """For "norm" / "silu" at one token: the skinny GEMV's plain-linear configs, tagged `UNFUSED`; else ()."""
    return tuple((UNFUSED, *c) for c in configs_for(1, "linear", n)) if kind != "linear" else ()


def is_pipelined(config) -> bool:
    """Whether a choice runs the pipelined GEMV (its first element is the `PIPELINED` tag)."""
    return config is not None and len(config) > 0 and config[0] == PIPELINED


def _tag(config) -> str | None:
    return config[0] if config is not None and len(config) > 0 and isinstance(config[0], str) else None


def run(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, config, w_scale: torch.Tensor | None = None,
        per_channel: bool = False, out_residual: torch.Tensor | None = None, **prologue):
    """The GEMV `config` names: a pipelined choice runs `skinny_gemv_pipelined` (float weight, x [1, K]; the
    prologue's kernel first), an FP8 weight (w_scale [N, ceil(K/128)]) `skinny_gemv_fp8_triton`, else
    `skinny_gemv_triton`; x [M, K] (or [M, 2K]); `prologue`: norm_weight, eps, residual, silu_mul. out_residual
    [M, N] of x's dtype: the result is ``out_residual + out``, added in the kernel's epilogue. ValueError for a
    pipelined choice on an FP8 weight."""
    tag = _tag(config)
    if tag is not None and w.dtype == _FP8:
        raise ValueError(f"gemv_dispatch: {config} is a float-weight GEMV; this weight is FP8")
    if tag == PIPELINED:
        return skinny_gemv_pipelined(x, w, bias, config=tuple(config[1:]), out_residual=out_residual, **prologue)
    if tag == PIPELINED_FUSED:
        return skinny_gemv_pipelined_fused(x, w, bias, config=tuple(config[1:]), out_residual=out_residual,
                                           **prologue)
    if tag == UNFUSED:
        return with_prologue(lambda h: skinny_gemv_triton(h, w, bias, config=tuple(config[1:]),
                                                          out_residual=out_residual), x, **prologue)
    if w.dtype == _FP8:
        return skinny_gemv_fp8_triton(x, w, w_scale, bias, per_channel=per_channel, config=config,
                                      out_residual=out_residual, **prologue)
    return skinny_gemv_triton(x, w, bias, config=config, out_residual=out_residual, **prologue)


def record(kind: str, n: int, k: int, bucket: int, config: tuple | None, fmt: str = "float") -> None:
    """Store the measured choice for (kind, N, K, bucket, weight format): a config, or None (cuBLAS won).
    ValueError for an unknown kind / bucket / format, or a pipelined choice that is not ("pipelined", four ints)
    at bucket 1 on float weights (the only place it runs)."""
    if kind not in KINDS or bucket not in (1, 2, 4, 8) or bucket > GEMV_MAX_M or fmt not in FORMATS:
        raise ValueError(f"record: kind {kind!r} / bucket {bucket} / format {fmt!r} not in {KINDS} / (1, 2, 4, 8) "
                         f"/ {FORMATS}")
    if config is not None and any(isinstance(c, str) for c in config):
        sizes = {PIPELINED: (4,), PIPELINED_FUSED: (4,), UNFUSED: (3, 4)}.get(_tag(config), ())
        if len(config) - 1 not in sizes or not all(isinstance(c, int) for c in config[1:]) or bucket != 1 \
                or fmt != "float" or (_tag(config) in (UNFUSED, PIPELINED_FUSED) and kind == "linear"):
            raise ValueError(f"record: {tuple(config)} for {kind!r} at bucket {bucket} / format {fmt!r}; a tagged "
                             f"choice is ({PIPELINED!r}, block_n, block_k, num_stages, num_warps) or, for 'norm' / "
                             f"'silu', ({PIPELINED_FUSED!r}, the same four) or ({UNFUSED!r}, block_n, block_k, "
                             "num_warps[, split_k]), at bucket 1, format 'float'")
    _choices[(kind, n, k, bucket, fmt)] = tuple(config) if config is not None else None


def choices() -> dict[str, str]:
    """{"kind NxK@bucket" (+ " fp8" / " fp8-channel"): "block_n/block_k/warps" (FP8: block_n/block_g/warps;
    pipelined: "pipelined/block_n/block_k/stages/warps") or "cublas"} of every tuned bucket (for logs and JSON)."""
    return {f"{kind} {n}x{k}@{b}" + ("" if fmt == "float" else f" {fmt}"): "/".join(map(str, cfg)) if cfg
            else "cublas" for (kind, n, k, b, fmt), cfg in sorted(_choices.items())}


def parse(text: str) -> tuple | None:
    """A choice from its `choices` text: "cublas" -> None, "4/512/2" -> (4, 512, 2), "pipelined/8/256/5/4" ->
    ("pipelined", 8, 256, 5, 4). ValueError for anything else."""
    if text == "cublas":
        return None
    parts = text.split("/")
    tag = parts[0] if parts[0] in TAGS else None
    ints = parts[1:] if tag else parts
    sizes = {PIPELINED: (4,), PIPELINED_FUSED: (4,), UNFUSED: (3, 4), None: (3, 4)}[tag]
    if not all(p.isdigit() for p in ints) or len(ints) not in sizes:
        raise ValueError(f"gemv_dispatch.parse: {text!r} is not 'cublas', 'n/k/warps[/split]', "
                         f"'{PIPELINED}/n/k/stages/warps', '{PIPELINED_FUSED}/n/k/stages/warps' or "
                         f"'{UNFUSED}/n/k/warps[/split]'")
    return ((tag,) if tag else ()) + tuple(int(p) for p in ints)


def clear() -> None:
    """Forget every measured choice (tests)."""
    _choices.clear()
