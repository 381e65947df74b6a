"""A decode step's grammar work (accepting the previous step's tokens, filling this step's token bitmask)
on a worker thread, beside the engine's main thread (structured outputs).

Why a thread, not only "after the forward launch": at decode batch 64 on small models the engine is
host-bound (the main thread's scheduling, input building, detokenizing and stop checks take longer
than the GPU's step), so grammar work that merely follows the forward launch on the main thread still
lengthens every step by its full cost. xgrammar's batched calls release the GIL, so on a worker thread
they run while the main thread completes the previous step; the main thread then only joins, copies the
mask (pinned host -> device, without waiting) and samples. vLLM overlaps the same work with the forward
pass and keeps detokenizing in another process, which this single-process engine does not have.

GIL hand-off: a thread that wants the GIL while another runs Python waits up to the interpreter's
switch interval (5 ms by default) before the holder is asked to drop it; the worker needs the GIL for a
few microseconds at each of its calls, so the interval is shortened to SWITCH_INTERVAL_S while a job is
in flight (restored when the last job in flight is joined).
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

SWITCH_INTERVAL_S = 5e-5
"""GIL switch interval (seconds) while a grammar job is in flight: bounds the worker's wait for the GIL."""


@dataclass
class GrammarJob:
    """One step's grammar work, started by `BitmaskFiller.start` and joined by `BitmaskFiller.finish`."""

    future: Future
    host: torch.Tensor | None
    """The host bitmask rows being filled; None when no row of the step is constrained."""
    event: Any = None
    """CUDA event recorded after `host` is copied to the device (the buffer's reuse waits for it)."""
    grammar_done: set[int] = field(default_factory=set)
    """seq_ids whose accepted token completes their grammar (a stop token)."""


class BitmaskFiller:
    """Runs xgrammar's batched accept and fill, now or on one worker thread; reuses its buffers.

    Args:
        xgr: the xgrammar module.
        width: words per bitmask row (ceil(vocab_size / 32)).
        max_threads: threads of xgrammar's batched fill.
    """

    def __init__(self, xgr: Any, width: int, max_threads: int):
        self._xgr = xgr
        self._batch = xgr.BatchGrammarMatcher(max_threads)
        self._buffers = _PinnedBuffers(width)
        self._device_rows: torch.Tensor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.stats = {"accept_s": 0.0, "fill_s": 0.0, "steps": 0, "main_s": 0.0, "wait_s": 0.0}
        """Seconds spent accepting / filling (on whichever thread ran them), the number of fills, and the
        calling (main) thread's seconds in run, start and finish (`main_s`), of which blocked joining the
        worker (`wait_s`)."""

    def run(self, accept: tuple[list, list, list], fill: tuple[list, list], num_rows: int,
            device: torch.device) -> torch.Tensor | None:
        """Accept, then fill, on this thread; the mask on `device` (None when `fill` has no matcher)."""
        start = time.perf_counter()
        host, event = self._buffers.next(num_rows, device) if fill[0] else (None, None)
        self._work(accept, fill, host)
        out = self._to_device(host, event, device)
        self.stats["main_s"] += time.perf_counter() - start
        return out

    def start(self, accept: tuple[list, list, list], fill: tuple[list, list], num_rows: int,
              device: torch.device, grammar_done: set[int]) -> GrammarJob:
        """Start `run`'s work on the worker thread and return at once; join with `finish`.

        accept: (matchers, token ids, seq_ids) to advance first; fill: (matchers, row indices) whose rows of
        a [num_rows, width] mask are filled, every other row all ones (every token allowed)."""
        start = time.perf_counter()
        host, event = self._buffers.next(num_rows, device) if fill[0] else (None, None)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fxrewrite-grammar")
        _switch_interval.enter()
        try:
            future = self._pool.submit(self._work, accept, fill, host)
        except BaseException:
            _switch_interval.exit()
            raise
        self.stats["main_s"] += time.perf_counter() - start
        return GrammarJob(future, host, event, grammar_done)

    def finish(self, job: GrammarJob, device: torch.device) -> torch.Tensor | None:
        """Wait for `job` (re-raising its error), then its mask on `device` (the copy does not wait)."""
        start = time.perf_counter()
        try:
            job.future.result()
        finally:
            _switch_interval.exit()
            self.stats["wait_s"] += time.perf_counter() - start
        out = self._to_device(job.host, job.event, device)
        self.stats["main_s"] += time.perf_counter() - start
        return out

    def _work(self, accept: tuple[list, list, list], fill: tuple[list, list], host: torch.Tensor | None) -> None:
        start = time.perf_counter()
        matchers, tokens, seq_ids = accept
        if matchers:
            i = _accept(self._xgr, matchers, tokens)
            if i >= 0:
                raise RuntimeError(f"sequence {seq_ids[i]}: token {tokens[i]} violates its grammar (a sampler bug)")
        filled = time.perf_counter()
        self.stats["accept_s"] += filled - start
        if host is not None:
            matchers, rows = fill
            if len(rows) < host.shape[0]:
                host.fill_(-1)  # unconstrained or finished rows: every token allowed
            self._batch.batch_fill_next_token_bitmask(matchers, host, rows)
            self.stats["fill_s"] += time.perf_counter() - filled
            self.stats["steps"] += 1

    def _to_device(self, host: torch.Tensor | None, event, device: torch.device) -> torch.Tensor | None:
        """`host` copied into the reused device buffer, without waiting (CPU: `host` itself)."""
        if host is None or device.type != "cuda":
            return host
        rows = host.shape[0]
        if self._device_rows is None or self._device_rows.shape[0] < rows:
            with torch.inference_mode(False):
                self._device_rows = torch.empty((max(rows, 64), host.shape[1]), dtype=torch.int32, device=device)
        out = self._device_rows[:rows]
        out.copy_(host, non_blocking=True)  # stream-ordered after the previous step's use of the buffer
        event.record()
        return out


def _accept(xgr: Any, matchers: list, tokens: list[int]) -> int:
    """Advance each matcher by its token (one batched call); the index of the first token refused, or -1.

    xgrammar's public `batch_accept_token` turns the binding's result array into Python bools one FFI
    call per element (about 2 us each, holding the GIL: 0.1-0.2 ms at batch 64), so the binding is called
    directly when this xgrammar has it, and its array answers `0 in result` at C speed."""
    core = getattr(getattr(xgr, "base", None), "_core", None)
    if core is None:
        accepted = xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        return -1 if all(accepted) else accepted.index(False)
    result = core.BatchGrammarMatcher.batch_accept_token([m._handle for m in matchers], tokens, False)
    return -1 if 0 not in result else [bool(ok) for ok in result].index(False)


class _PinnedBuffers:
    """Two host bitmask buffers used in turn (pinned when CUDA is there), each with the CUDA event of its
    last copy to the device: a buffer is refilled only after that copy ran, without a device sync."""

    def __init__(self, width: int):
        self.width = width
        self._slots: list[list] = [[None, None], [None, None]]
        self._turn = 0

    def next(self, rows: int, device: torch.device):
        slot = self._slots[self._turn]
        self._turn ^= 1
        if slot[0] is None or slot[0].shape[0] < rows:
            capacity = max(rows, 64)
            with torch.inference_mode(False):  # a normal tensor: refilled in place in and out of inference mode
                slot[0] = torch.empty((capacity, self.width), dtype=torch.int32,
                                      pin_memory=device.type == "cuda")
            slot[1] = torch.cuda.Event() if device.type == "cuda" else None
        elif slot[1] is not None:
            slot[1].synchronize()  # its previous copy was queued two steps ago: done in practice
        return slot[0][:rows], slot[1]


class _SwitchInterval:
    """The process's GIL switch interval, shortened while any grammar job is in flight (counted, so
    several engines in one process restore the original value only when the last job is joined)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved = 0.0

    def enter(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, SWITCH_INTERVAL_S))
            self._depth += 1

    def exit(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                sys.setswitchinterval(self._saved)


_switch_interval = _SwitchInterval()
