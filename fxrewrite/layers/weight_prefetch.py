"""Prefetching the next projection's weight into L2 while a latency-bound kernel runs (a measurement switch).

``FXREWRITE_L2_PREFETCH_MB`` (default 0: off): at up to `MAX_TOKENS` tokens a step, the native models' attention forks a
side stream off the current one after its QKV projection and, there, asks for the first that many megabytes of the
output projection's weight to be brought into L2 (`fxrewrite.kernels.l2_prefetch`), while q/k norm, rotary, the
cache write, the decode kernel and its merge run on the main stream; the model's forward joins the side stream at
its end (a CUDA graph capture must rejoin every stream it forked). Under torch.compile, on a CPU and for prefill it
does nothing. Not yet measured on a GPU: off until a benchmark says it pays.
"""

from __future__ import annotations

import os

import torch

from fxrewrite.kernels.l2_prefetch import l2_prefetch_triton

__all__ = ["MAX_TOKENS", "prefetch_budget_bytes", "prefetch_weight", "join_prefetches"]

MAX_TOKENS = 8
"""Token counts up to which a step streams weights with HBM to spare during attention (decode at small batch)."""
_streams: dict[torch.device, torch.cuda.Stream] = {}
_pending: set[torch.device] = set()  # devices whose side stream holds prefetches not yet joined


def prefetch_budget_bytes() -> int:
    """``FXREWRITE_L2_PREFETCH_MB`` in bytes (0 when unset: off). ValueError naming a value that is not a whole number
    of megabytes."""
    value = os.environ.get("FXREWRITE_L2_PREFETCH_MB", "0")
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f"FXREWRITE_L2_PREFETCH_MB={value!r}: expected a whole number of megabytes (0: off)")
    return int(value) << 20


def prefetch_weight(weight: torch.Tensor, num_tokens: int) -> None:
    """Fork a side stream off the current one and prefetch up to the budget of `weight` (contiguous) into L2 there;
    no-op with a budget of 0, a weight not on a CUDA device, more than MAX_TOKENS tokens, or under torch.compile."""
    if torch.compiler.is_compiling() or not weight.is_cuda:  # first: no guard on the token count under compile
        return
    budget = prefetch_budget_bytes()
    if not budget or num_tokens > MAX_TOKENS:
        return
    device = weight.device
    side = _streams.get(device)
    if side is None:
        side = _streams[device] = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        l2_prefetch_triton(weight, budget)
    _pending.add(device)


def join_prefetches(device: torch.device) -> None:
    """Make `device`'s current stream wait for its side stream's prefetches, if any were issued since the last join."""
    if device in _pending:
        _pending.discard(device)
        torch.cuda.current_stream(device).wait_stream(_streams[device])
