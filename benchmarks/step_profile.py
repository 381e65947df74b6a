"""The host's and the device's time per engine step over a timed run (`step_profile`), split by batch size.

A throughput figure mixes full-batch steps, where the device sets the pace, with the run's tail of a few sequences,
where the host's scheduling, input building and output handling can: these figures say which steps were which.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

__all__ = ["BATCH_BANDS", "step_profile"]

BATCH_BANDS = (1, 8, 32, 128)
"""Lower bounds of the scheduled-sequence bands `step_profile` splits its steps into (1-7, 8-31, 32-127, 128+)."""


@contextmanager
def step_profile(runner):
    """Seconds spent, over the steps run inside the block, in `execute_model_async` ("launch": building
    the inputs and queueing the forward and sampler on the device) and blocked waiting for a step's
    tokens ("wait": the device is behind the host). Whatever else the run took is host work (scheduling,
    output processing), which the device may hide by running a launched step meanwhile ("gpu_idle" below says
    how much it did not). Yields the dict, filled on exit; with
    "by_batch": per band of scheduled sequences (`BATCH_BANDS`), its steps and the mean milliseconds of
    a step's launch, of its wait and of the interval from its launch to the next one (the step's share of
    the wall time). On a CUDA runner in this process, also the device's side from CUDA events recorded around
    each launch: "gpu_idle_ms", the device's idle time between a step's last queued work and the next launch's
    start (the host's scheduling and output work not hidden; a lower bound on the idle time, since a launch that
    begins on an idle device leaves it idle while it builds the inputs), and "gpu_ms", the device's time from a
    launch's start to its last queued work (that idle part included); the totals get "gpu_busy" and "gpu_idle"
    seconds."""
    totals = {"launch": 0.0, "wait": 0.0, "steps": 0}
    # A pipelined executor is not async-scheduled but its micro-batches go through execute_model_async too
    if not (getattr(runner, "supports_async", False) or getattr(runner, "pipeline_depth", 1) > 1):
        yield totals
        return
    launch = runner.execute_model_async
    device = getattr(runner, "device", None)
    events = isinstance(device, torch.device) and device.type == "cuda"
    series: list[list] = []  # per step: [scheduled sequences, launch start, launch s, wait s, start event, end event]

    def timed_launch(sched, previous=None, **kwargs):
        t0 = time.perf_counter()
        row = [len(getattr(sched, "scheduled", ())), t0, 0.0, 0.0, None, None]
        series.append(row)
        if events:
            row[4], row[5] = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            row[4].record()
        try:
            pending = launch(sched, previous, **kwargs)
        finally:
            if events:
                row[5].record()
            row[2] = time.perf_counter() - t0
        result = pending.result

        def timed_result():
            t1 = time.perf_counter()
            try:
                return result()
            finally:
                row[3] += time.perf_counter() - t1

        pending.result = timed_result
        return pending

    runner.execute_model_async = timed_launch
    try:
        yield totals
    finally:
        del runner.execute_model_async
        totals.update(launch=round(sum(r[2] for r in series), 3), wait=round(sum(r[3] for r in series), 3),
                      steps=len(series))
        if events and series:
            totals.update(_device_times(series))
        totals["by_batch"] = _batch_bands(series, events)


def _device_times(series: list[list]) -> dict:
    """Replace each row's two CUDA events by [its device ms, the idle ms before the next step's start] (None for
    the last step); the totals in seconds."""
    torch.cuda.synchronize()
    for i, row in enumerate(series):
        row[4:] = [row[4].elapsed_time(row[5]), row[5].elapsed_time(series[i + 1][4]) if i + 1 < len(series) else None]
    return {"gpu_busy": round(sum(r[4] for r in series) / 1e3, 3),
            "gpu_idle": round(sum(r[5] for r in series[:-1]) / 1e3, 3)}


def _batch_bands(series: list[list], events: bool) -> dict:
    """`step_profile`'s per-step rows -> {"1-7": {"steps", "launch_ms", "wait_ms", "interval_ms"[, "gpu_ms",
    "gpu_idle_ms"]}, ...} (means; the last step has no next launch and is left out of the intervals)."""
    bounds = (*BATCH_BANDS, float("inf"))
    out = {}

    def mean_ms(values: list[float], scale: float) -> float | None:
        return round(scale * sum(values) / len(values), 3) if values else None

    for lo, hi in zip(bounds, bounds[1:]):
        rows = [(i, r) for i, r in enumerate(series) if lo <= r[0] < hi]
        if not rows:
            continue
        name = f"{lo}-{hi - 1}" if hi != float("inf") else f"{lo}+"
        band = out[name] = {
            "steps": len(rows), "launch_ms": mean_ms([r[2] for _, r in rows], 1e3),
            "wait_ms": mean_ms([r[3] for _, r in rows], 1e3),
            "interval_ms": mean_ms([series[i + 1][1] - r[1] for i, r in rows if i + 1 < len(series)], 1e3)}
        if events:
            band["gpu_ms"] = mean_ms([r[4] for _, r in rows], 1.0)
            band["gpu_idle_ms"] = mean_ms([r[5] for _, r in rows if r[5] is not None], 1.0)
    return out
