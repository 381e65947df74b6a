"""A worker's phase watchdog: which phase of loading (or which step) a worker process is in, said on
stderr when one phase lasts too long, so a hang names its place instead of printing nothing.

A multi-process engine whose workers must issue the same collectives in the same order (data parallel
x expert parallel: every MoE layer all-gathers and reduce-scatters across replicas) hangs silently when
one replica takes another path. `install(label)` starts a daemon thread in the worker; the code marks
its phases with `phase(name)` (a no-op in a process without a watchdog, e.g. a single-process engine).
When a watched phase is still current after `FXREWRITE_WATCHDOG_S` seconds (default 60; 0 turns the
watchdog off) the thread prints ``[fxrewrite watchdog] <label>: still in '<phase>' after N s`` and every
thread's Python stack (`faulthandler`), then repeats the line (not the stacks) each period. A phase
entered with watched=False (waiting for the driver's next step: an idle engine) is never reported.

Only host-side state is read: nothing here touches CUDA, so it is safe while a CUDA graph is captured.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time

logger = logging.getLogger(__name__)

WATCHDOG_ENV = "FXREWRITE_WATCHDOG_S"
DEFAULT_PERIOD_S = 60.0
LOAD_LOG_ENV = "FXREWRITE_LOAD_LOG"
"""1: every worker prints each load phase on stderr as it enters it (with the seconds since it started)."""


class PhaseWatchdog:
    """The current phase of each slot of this process ("main": the worker's loop, "results": its result
    thread), with its start time, and the thread that reports a phase that lasts too long."""

    def __init__(self, label: str, period_s: float) -> None:
        self.label, self.period_s = label, period_s
        self.started = time.monotonic()
        self._slots: dict[str, tuple[str, float, bool, int]] = {}
        """slot -> (phase name, start time, watched, sequence number)."""
        self._seq = 0
        self._lines: dict[str, tuple[int, float]] = {}
        """slot -> (sequence number, time) of the last line printed."""
        self._dumped: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fxrewrite-watchdog", daemon=True)
        self._thread.start()

    def phase(self, name: str, watched: bool = True, slot: str = "main") -> None:
        """Enter phase `name` in `slot` (its clock starts now)."""
        self._seq += 1
        self._slots[slot] = (name, time.monotonic(), watched, self._seq)

    def current(self, slot: str = "main") -> str | None:
        entry = self._slots.get(slot)
        return entry[0] if entry is not None else None

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(min(self.period_s, 5.0)):
            for slot, (name, start, watched, seq) in list(self._slots.items()):
                now = time.monotonic()
                last_seq, last_time = self._lines.get(slot, (None, 0.0))
                if not watched or now - start < self.period_s or (last_seq == seq and now - last_time < self.period_s):
                    continue
                print(f"[fxrewrite watchdog] {self.label} ({slot}): still in '{name}' after {now - start:.0f} s",
                      file=sys.stderr, flush=True)
                self._lines[slot] = (seq, now)
                if seq not in self._dumped:  # every thread's Python stack, once per stuck phase
                    self._dumped.add(seq)
                    try:
                        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                    except (ValueError, AttributeError, OSError):  # a stderr without a file descriptor
                        print("(thread stacks not available: stderr has no file descriptor)", file=sys.stderr)
                    sys.stderr.flush()


_watchdog: PhaseWatchdog | None = None


def install(label: str) -> PhaseWatchdog | None:
    """Start this process's watchdog (None when `FXREWRITE_WATCHDOG_S` is 0). Idempotent."""
    global _watchdog
    if _watchdog is None:
        period = float(os.environ.get(WATCHDOG_ENV, DEFAULT_PERIOD_S) or 0)
        if period > 0:
            _watchdog = PhaseWatchdog(label, period)
    return _watchdog


def phase(name: str, watched: bool = True, slot: str = "main", log: bool = True) -> None:
    """Mark this process's current phase in `slot` (no-op without `install`). A watched "main" phase with
    `log` (the load sequence, not every step) is also logged: at INFO, or on stderr with the seconds since
    the watchdog started when `LOAD_LOG_ENV` is 1 (worker processes have no logging set up)."""
    if _watchdog is None:
        return
    _watchdog.phase(name, watched, slot)
    if watched and slot == "main" and log:
        if os.environ.get(LOAD_LOG_ENV) == "1":
            print(f"[fxrewrite load] {_watchdog.label} +{time.monotonic() - _watchdog.started:.1f} s: {name}",
                  file=sys.stderr, flush=True)
        else:
            logger.info("%s: %s", _watchdog.label, name)


def current_phase(slot: str = "main") -> str | None:
    return _watchdog.current(slot) if _watchdog is not None else None
