"""A decode step's grammar work (accepting the previous step's tokens, filling this step's token bitmask)
on worker threads, beside the engine's main thread (structured outputs).

Why threads, not only "after the forward launch": at decode batch 64 on small models the engine is about
host-bound (the main thread's scheduling, input building, detokenizing and stop checks take about as long
as the GPU's step), so grammar work that merely follows the forward launch on the main thread still
lengthens every step by its full cost. xgrammar's calls release the GIL, so on worker threads they run
while the main thread completes the previous step and schedules the next; the step samples when its
tokens are first needed (`ModelRunner`'s deferred sample), and only then does the main thread join the
job, copy the mask (pinned host -> device, without waiting) and launch the sampler. vLLM overlaps the
same work with the forward pass and keeps detokenizing in another process, which this single-process
engine does not have.

GIL hand-off: a thread that wants the GIL while another runs Python waits up to the interpreter's
switch interval (5 ms by default) before the holder is asked to drop it; a worker needs the GIL for a
few microseconds around each of its calls, so the interval is shortened to SWITCH_INTERVAL_S while a job
is in flight (restored when the last job in flight ends).
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

STAT_KEYS = ("accept_s", "fill_s", "job_s", "main_s", "wait_s", "tokens_wait_s", "complete_s", "steps")

SWITCH_INTERVAL_S = 5e-5
"""GIL switch interval (seconds) while a grammar job is in flight: bounds the worker's wait for the GIL."""


@dataclass
class GrammarJob:
    """One step's grammar work, started by `BitmaskFiller.start` and joined by `BitmaskFiller.finish`."""

    futures: list[Future]
    host: torch.Tensor | None
    """The host bitmask rows being filled; None when no row of the step is constrained."""
    event: Any = None
    """CUDA event recorded after `host` is copied to the device (the buffer's reuse waits for it)."""
    grammar_done: set[int] = field(default_factory=set)
    """seq_ids whose accepted token completes their grammar (a stop token)."""
    started: float = 0.0
    """perf_counter() when the job was submitted."""
    finished: list[tuple[float, float, float]] = field(default_factory=list)
    """Per chunk: (perf_counter() when it ended, its seconds accepting, filling); list.append is atomic."""


class BitmaskFiller:
    """Runs xgrammar's batched accept and fill, now or on `num_threads` persistent worker threads (the
    matchers split in interleaved chunks, each chunk accepted then filled by one thread); reuses buffers.

    Why not xgrammar's own `max_threads`: its batched fill builds a fresh C++ thread pool on every call
    (and joins it), which at batch 64 costs more than it saves; persistent Python threads around GIL-free
    single-threaded calls pay two GIL hand-offs per chunk instead.

    Args:
        xgr: the xgrammar module.
        width: words per bitmask row (ceil(vocab_size / 32)).
        num_threads: worker threads of a started job (chunks per step).
    """

    def __init__(self, xgr: Any, width: int, num_threads: int):
        self._xgr = xgr
        self._core = getattr(getattr(xgr, "base", None), "_core", None)
        self._batches = [xgr.BatchGrammarMatcher(1)]  # max_threads 1: the calling thread fills
        self.num_threads = max(1, num_threads)
        self._buffers = _PinnedBuffers(width)
        self._copy_stream = None  # CUDA: the side stream of the mask copies, and its two device buffers
        self._device_slots: list = [None, None]
        self._device_turn = 0
        self._used = None
        self._retired: list[torch.Tensor] = []
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self.stats = dict.fromkeys(STAT_KEYS, 0.0)
        """Seconds: accepting / filling (summed over the threads that ran them), a started job's wall time
        (`job_s`), the calling (main) thread's time in run, start and finish (`main_s`), of which blocked
        joining the worker (`wait_s`); `steps`: the number of fills. `StructuredOutputManager` adds the
        main thread's wait for the previous step's tokens (`tokens_wait_s`) and its completion of that step
        while the job ran (`complete_s`)."""

    def run(self, accept: tuple[list, list, list], fill: tuple[list, list], num_rows: int,
            device: torch.device) -> torch.Tensor | None:
        """Accept, then fill, on this thread; the mask on `device` (None when `fill` has no matcher)."""
        start = time.perf_counter()
        host, event = self._buffers.next(num_rows, device) if fill[0] else (None, None)
        self.stats["steps"] += host is not None
        self._add_times(*self._work(accept, fill, host, _missing_rows(fill[1], num_rows, host)))
        out = self._to_device(host, event, device)
        self.stats["main_s"] += time.perf_counter() - start
        return out

    def start(self, accepts: list[tuple[list, list, list]], fills: list[tuple[list, list]], num_rows: int,
              device: torch.device, grammar_done: set[int]) -> GrammarJob:
        """Start `run`'s work on the worker threads, chunk i of `accepts` and of `fills` on one thread (a
        matcher must be in the same chunk of both), and return at once; join with `finish`.

        accepts: chunks of (matchers, token ids, seq_ids) to advance first; fills: chunks of (matchers, row
        indices) whose rows of a [num_rows, width] mask are filled, every other row all ones."""
        start = time.perf_counter()
        filled = sum(len(chunk_rows) for _, chunk_rows in fills)
        host, event = self._buffers.next(num_rows, device) if filled else (None, None)
        self.stats["steps"] += host is not None
        pool = self._worker_pool(len(fills))
        missing = None if filled == num_rows else _missing_rows([r for _, rs in fills for r in rs], num_rows, host)
        job = GrammarJob([], host, event, grammar_done, start)
        _switch_interval.enter()
        try:
            for c, (accept, fill) in enumerate(zip(accepts, fills)):
                if accept[0] or fill[0] or (c == 0 and missing is not None):
                    job.futures.append(pool.submit(self._chunk, job, accept, fill, missing if c == 0 else None, c))
        finally:  # restored when the last chunk ends (also when a submit failed, or a job is never joined)
            _switch_interval.exit_when_done(job.futures)
        self.stats["main_s"] += time.perf_counter() - start
        return job

    def _worker_pool(self, k: int) -> ThreadPoolExecutor:
        if self._pool is None or self._pool_size != k:  # a changed num_threads: a new pool
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool, self._pool_size = ThreadPoolExecutor(k, thread_name_prefix="fxrewrite-grammar"), k
        while len(self._batches) < k:
            self._batches.append(self._xgr.BatchGrammarMatcher(1))
        return self._pool

    def finish(self, job: GrammarJob, device: torch.device) -> torch.Tensor | None:
        """Wait for `job` (re-raising its error), then its mask on `device` (the copy does not wait)."""
        start = time.perf_counter()
        try:
            for future in job.futures:
                future.result()
        finally:
            self.stats["wait_s"] += time.perf_counter() - start
        if job.finished:
            self.stats["job_s"] += max(end for end, _, _ in job.finished) - job.started
            for _, accept_s, fill_s in job.finished:
                self._add_times(accept_s, fill_s)
        out = self._to_device(job.host, job.event, device)
        self.stats["main_s"] += time.perf_counter() - start
        return out

    def _chunk(self, job: GrammarJob, accept, fill, missing, chunk: int) -> None:
        times = self._work(accept, fill, job.host, missing, chunk)
        job.finished.append((time.perf_counter(), *times))

    def _add_times(self, accept_s: float, fill_s: float) -> None:
        self.stats["accept_s"] += accept_s
        self.stats["fill_s"] += fill_s

    def _work(self, accept: tuple[list, list, list], fill: tuple[list, list], host: torch.Tensor | None,
              missing: torch.Tensor | None, chunk: int = 0) -> tuple[float, float]:
        """Accept, then fill (`chunk`: which thread's xgrammar batch object); (seconds accepting, filling)."""
        start = time.perf_counter()
        matchers, tokens, seq_ids = accept
        if matchers:
            i = self._accept(matchers, tokens)
            if i >= 0:
                raise RuntimeError(f"sequence {seq_ids[i]}: token {tokens[i]} violates its grammar (a sampler bug)")
        filled = time.perf_counter()
        if host is not None:
            if missing is not None:
                host.index_fill_(0, missing, -1)  # unconstrained or finished rows: every token allowed
            if fill[0]:
                self._fill(fill[0], host, fill[1], chunk)
        return filled - start, time.perf_counter() - filled

    def _fill(self, matchers: list, host: torch.Tensor, rows: list[int], chunk: int) -> None:
        """Fill `rows` of `host` (one GIL-free call, on this thread; each chunk has its own batch object)."""
        batch = self._batches[chunk]
        if self._core is None:
            batch.batch_fill_next_token_bitmask(matchers, host, rows)
        else:
            batch._handle.batch_fill_next_token_bitmask([m._handle for m in matchers], host, rows, False)

    def _accept(self, matchers: list, tokens: list[int]) -> int:
        """Advance each matcher by its token (one batched call); the index of the first token refused, or -1.

        xgrammar's public `batch_accept_token` turns the binding's result array into Python bools one FFI
        call per element (about 2 us each, holding the GIL: 0.1-0.2 ms at batch 64), so the binding is
        called directly when this xgrammar has it, and its array answers `0 in result` at C speed."""
        if self._core is None:
            accepted = self._xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
            return -1 if all(accepted) else accepted.index(False)
        result = self._core.BatchGrammarMatcher.batch_accept_token([m._handle for m in matchers], tokens, False)
        return -1 if 0 not in result else [bool(ok) for ok in result].index(False)

    def _to_device(self, host: torch.Tensor | None, event, device: torch.device) -> torch.Tensor | None:
        """`host` copied into one of two reused device buffers on a side stream, without waiting (CPU:
        `host` itself). The copy overlaps the forward pass still running on the compute stream, which only
        waits for it before the sampler that reads the mask (stream-ordered, no host sync)."""
        if host is None or device.type != "cuda":
            return host
        compute = torch.cuda.current_stream(device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
            self._device_slots = [None, None]
            self._used = torch.cuda.Event()
            self._used.record(compute)
        slot = self._device_turn
        self._device_turn ^= 1
        rows, buffer = host.shape[0], self._device_slots[slot]
        if buffer is None or buffer.shape[0] < rows:
            if buffer is not None:
                self._retired.append(buffer)  # a pending kernel may still read it: never freed
            with torch.inference_mode(False):
                buffer = torch.empty((max(rows, 64, 2 * (0 if buffer is None else buffer.shape[0])), host.shape[1]),
                                     dtype=torch.int32, device=device)
            self._device_slots[slot] = buffer
        # This slot's last reader is the sampler launched two masks ago, before `_used` was recorded.
        self._copy_stream.wait_event(self._used)
        out = buffer[:rows]
        with torch.cuda.stream(self._copy_stream):
            out.copy_(host, non_blocking=True)
            event.record(self._copy_stream)  # the pinned host buffer's reuse waits for this
        self._used.record(compute)  # every sampler launched so far (the other slot's reader included)
        compute.wait_event(event)
        return out


def _missing_rows(rows: list[int], num_rows: int, host: torch.Tensor | None) -> torch.Tensor | None:
    """The row indices of `host` that no matcher fills (they are set to all ones), or None."""
    if host is None or len(rows) == num_rows:
        return None
    keep = torch.ones(num_rows, dtype=torch.bool)
    keep[rows] = False
    return keep.nonzero().flatten()


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

    def exit_when_done(self, futures: list[Future]) -> None:
        """`exit` once every one of `futures` is done (now, when there is none)."""
        if not futures:
            self.exit()
            return
        pending = [len(futures)]
        lock = threading.Lock()

        def done(_future: Future) -> None:
            with lock:
                pending[0] -= 1
                last = pending[0] == 0
            if last:
                self.exit()

        for future in futures:
            future.add_done_callback(done)


_switch_interval = _SwitchInterval()
