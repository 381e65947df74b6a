"""Load-time choice of the MoE router's launch shape per (E, H, top_k) (`fxrewrite.kernels.moe_router`),
measured on the device before the engine captures its decode CUDA graphs.

Candidates: every `ROUTER_CONFIGS` entry of the fused one-launch router and the two-launch GEMM +
`select_experts` pair (``GEMM``). Each is first checked against the float32 reference at 1 and at
`FUSED_ROUTER_MAX_TOKENS` tokens, then timed at one token (batch-1 decode, the case the fused router is
for) as `fxrewrite.kernels.fp8_tune` times its backends: one CUDA graph of calls over as many gate copies
as overflow the H200's 50 MB L2 twice (each call reads its gate from HBM, as a decode step does, where
the other layers' weights evict it), replayed and timed with CUDA events. The fastest checked candidate
is recorded (`moe_router.record`). The check compares probability mass, not ids: bf16 logits rounded
after a different accumulation order may swap two experts of equal score, which is not an error,
while a wrong launch shape selects experts of little mass or non-finite weights.
"""

from __future__ import annotations

import json
import logging
import os

import torch
import torch.nn.functional as F

from fxrewrite.kernels import env_choice, moe_router
from fxrewrite.kernels.fp8_tune import graph_time_us, release_cached_memory
from fxrewrite.kernels.moe_router import FUSED_ROUTER_MAX_TOKENS, GEMM, ROUTER_CONFIGS, route_experts

__all__ = ["TOLERANCE", "candidates", "check", "tune_shape", "tune"]

logger = logging.getLogger(__name__)

TOLERANCE = 0.02
"""Largest relative shortfall of the chosen experts' probability mass against the reference's, and
largest relative error of the sorted top-k weights (bf16 rounding of the logits is ~1e-2)."""
_L2_BYTES = 128 << 20
_MAX_COPIES = 256


def candidates() -> list:
    """The GEMM pair first (the baseline), then every fused config."""
    return [GEMM, *ROUTER_CONFIGS]


def check(weight: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str, choice) -> None:
    """Raise ValueError unless `choice` routes random hidden states like the float32 reference."""
    gen = torch.Generator(device=weight.device).manual_seed(0)
    for t in sorted({1, FUSED_ROUTER_MAX_TOKENS}):
        x = torch.randn(t, weight.shape[1], device=weight.device, dtype=weight.dtype, generator=gen)
        got_w, got_ids = route_experts(x, weight, top_k, renormalize, scoring_func, config=choice)
        if bool(((got_ids < 0) | (got_ids >= weight.shape[0])).any()):  # before any gather reads with them
            raise ValueError(f"T={t}: expert ids outside [0, {weight.shape[0]})")
        logits = F.linear(x.float(), weight.float())
        probs = logits.softmax(-1) if scoring_func == "softmax" else logits.sigmoid()
        want_w, want_ids = moe_router.route_experts_ref(x.float(), weight.float(), top_k, renormalize, scoring_func)
        got_mass, want_mass = probs.gather(1, got_ids).sum(-1), probs.gather(1, want_ids).sum(-1)
        shortfall = float(((want_mass - got_mass) / want_mass).max())
        w_err = float(((got_w.sort(-1).values - want_w.sort(-1).values).abs() / want_w.abs().max()).max())
        repeated = bool((got_ids.sort(-1).values.diff(dim=-1) == 0).any())
        if not (shortfall < TOLERANCE and w_err < TOLERANCE) or repeated:
            raise ValueError(f"T={t}: mass shortfall {shortfall:.3g}, weight error {w_err:.3g} (>= {TOLERANCE}) "
                             f"or repeated experts")


def _name(choice) -> str:
    return choice if isinstance(choice, str) else "/".join(str(int(v)) for v in choice)


def tune_shape(num_experts: int, hidden: int, top_k: int, renormalize: bool, scoring_func: str, device,
               dtype: torch.dtype) -> dict[str, float | str]:
    """{candidate name: us per call at one token, or "error: ..."}; records the fastest checked candidate."""
    nbytes = num_experts * hidden * torch.tensor([], dtype=dtype).element_size()
    copies = max(1, min(_MAX_COPIES, -(-_L2_BYTES // nbytes)))
    gates = [torch.randn(num_experts, hidden, device=device, dtype=dtype).div_(hidden ** 0.5) for _ in range(copies)]
    x = torch.randn(1, hidden, device=device, dtype=dtype)
    results: dict[str, float | str] = {}
    best = None
    for choice in candidates():
        name = _name(choice)
        try:
            check(gates[0], top_k, renormalize, scoring_func, choice)
            results[name] = graph_time_us(
                lambda i, c=choice: route_experts(x, gates[i], top_k, renormalize, scoring_func, config=c)[1],
                copies, copies)
        except Exception as e:  # noqa: BLE001 - a candidate that fails or is wrong here is never chosen
            results[name] = f"error: {type(e).__name__}: {str(e)[:200]}"
            continue
        if best is None or results[name] < results[_name(best)]:
            best = choice
    moe_router.record(num_experts, hidden, top_k, best)
    return results


def tune(shapes: set[tuple[int, int, int, bool, str]], device, dtype: torch.dtype) -> dict:
    """Tune every (E, H, top_k, renormalize, scoring_func) of `shapes`; returns {"ExH top-k": timings}.
    No-op ({}) unless `device` is CUDA and FXREWRITE_ROUTER_TUNE is not "0" (nor FXREWRITE_ROUTER_CONFIG
    set: a forced choice is kept). FXREWRITE_ROUTER_TUNE_LOG=path appends one JSON line of the timings."""
    if (torch.device(device).type != "cuda" or env_choice("FXREWRITE_ROUTER_TUNE", "1", ("1", "0")) == "0"
            or os.environ.get("FXREWRITE_ROUTER_CONFIG")):
        return {}
    release_cached_memory()  # the captures need device memory the cache may hold (the model's load temporaries)
    timings = {}
    for e, h, k, renormalize, scoring in sorted(shapes):
        key = f"{e}x{h} top-{k}"
        timings[key] = tune_shape(e, h, k, renormalize, scoring, device, dtype)
        logger.info("MoE router %s: %s, chose %s", key, timings[key], _name(moe_router.choice_for(e, h, k)))
        timings[key]["chosen"] = _name(moe_router.choice_for(e, h, k))
    torch.cuda.empty_cache()  # the scratch gates must not count as used when the KV cache is sized
    if os.environ.get("FXREWRITE_ROUTER_TUNE_LOG"):
        with open(os.environ["FXREWRITE_ROUTER_TUNE_LOG"], "a") as f:
            f.write(json.dumps({"router_timings_us": timings}) + "\n")
    return timings
