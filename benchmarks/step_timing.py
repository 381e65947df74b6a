"""Where a timed run's wall time went between steps: the spread of decode step times, and garbage-collector pauses.

A latency figure is the mean step time; a one-off stall (a garbage collection of the oldest generation, an
allocator call, a late import) spread over 127 steps looks like a uniform per-step overhead. These figures
separate the two: a median step near the CUDA graph's replay time with a few long steps is a stall, a median
above it is per-step host work.
"""

from __future__ import annotations

import gc
import statistics
import threading
import time
from contextlib import contextmanager

__all__ = ["collect_untimed", "gc_pauses", "decode_step_summary"]

_untimed = threading.local()


def collect_untimed() -> None:
    """A full collection (`gc.collect()`) that `gc_pauses` does not count: the harness's own, just before a timed run
    starts (so that a gen-2 pass left over from loading does not land in the timing), is not a pause of the run."""
    _untimed.active = True
    try:
        gc.collect()
    finally:
        _untimed.active = False


@contextmanager
def gc_pauses():
    """Record every collection of Python's cyclic garbage collector inside the block (`gc.callbacks`), but
    `collect_untimed`'s. Yields a dict filled on exit: {"collections": {generation: count}, "pause_ms": total
    milliseconds, "max_pause_ms"}."""
    pauses: list[tuple[int, float]] = []
    started: list[float] = []

    def callback(phase: str, info: dict) -> None:
        if getattr(_untimed, "active", False):
            return
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((info["generation"], time.perf_counter() - started.pop()))

    summary: dict = {}
    gc.callbacks.append(callback)
    try:
        yield summary
    finally:
        gc.callbacks.remove(callback)
        counts: dict[str, int] = {}
        for generation, _ in pauses:
            counts[str(generation)] = counts.get(str(generation), 0) + 1
        summary.update(collections=counts, pause_ms=round(sum(s for _, s in pauses) * 1e3, 3),
                       max_pause_ms=round(max((s for _, s in pauses), default=0.0) * 1e3, 3))


def decode_step_summary(step_end_s: list[float], first_token_s: float, last_token_s: float) -> dict:
    """Figures of the step intervals between the first and the last output token (seconds from the run's start
    at the end of each engine step, ascending): median and longest step (ms), and the stall time, what the steps
    longer than twice the median took beyond the median (ms). An empty dict when fewer than two steps ended in
    that window."""
    ends = [t for t in step_end_s if first_token_s <= t <= last_token_s]
    steps = [b - a for a, b in zip(ends, ends[1:])]
    if not steps:
        return {}
    median = statistics.median(steps)
    long_steps = [s for s in steps if s > 2 * median]
    return {"step_ms_median": round(median * 1e3, 3), "step_ms_max": round(max(steps) * 1e3, 3),
            "long_steps": len(long_steps), "stall_ms": round(sum(s - median for s in long_steps) * 1e3, 3)}
