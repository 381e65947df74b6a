"""Python's cyclic garbage collector around the engine: fewer young-generation passes while it steps, and the
startup heap left out of full collections while a server runs."""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

__all__ = ["fewer_gc_passes", "frozen_startup_heap"]

_lock = threading.Lock()
_young = {"users": 0, "saved": None}
_frozen = {"users": 0}


@contextmanager
def _shared(state: dict, enter, leave):
    """The collector's settings are the process's: blocks may overlap (two servers in one process, LLM.generate in
    two threads) and end in any order. `enter(first)` runs at each block's start (first: no other block holds the
    setting), `leave()` when the last block holding it ends."""
    with _lock:
        enter(state["users"] == 0)
        state["users"] += 1
    try:
        yield
    finally:
        with _lock:
            state["users"] -= 1
            if state["users"] == 0:
                leave()


@contextmanager
def fewer_gc_passes(gen0_threshold: int = 50_000):
    """Python's cyclic GC collects its young generation every 700 net allocations, and every tenth of those
    passes also walks the middle one; an engine step with a thousand sequences allocates several objects
    per sequence (samples, logprob dicts, scheduled entries), so passes ran every step, and the walks of
    the sequences' ever-growing logprob dicts cost 10-20% of the host time of a 1024-sequence decode step
    (CPU profile of the engine loop, thread time, this session). During the run the young threshold is
    raised to `gen0_threshold` (never lowered), and restored when the last such block ends; nothing else
    changes."""
    def raise_threshold(first: bool) -> None:
        now = gc.get_threshold()
        if first:
            _young["saved"] = now
        gc.set_threshold(max(now[0], gen0_threshold), *now[1:])

    with _shared(_young, raise_threshold, lambda: gc.set_threshold(*_young["saved"])):
        yield


@contextmanager
def frozen_startup_heap():
    """While the block runs, the objects alive at its start (modules, parameters, tokenizer, compiled code: a loaded
    Qwen3-0.6B engine holds ~408k tracked objects, whose full collection took 265-386 ms on a 2-core CPU) go to
    the collector's permanent generation (`gc.freeze`), so full collections walk only what was made since; on exit
    they go back (`gc.unfreeze`) and can be collected again. vLLM's API server and engine core freeze their
    startup heap the same way. A collection first, so that garbage made at startup is not kept for the block's
    lifetime. Meant for a process's long-lived engines (`fxrewrite serve`); overlapping blocks unfreeze when the last
    one ends."""
    def freeze(first: bool) -> None:  # a block starting inside another freezes what was made since (its engine)
        gc.collect()
        gc.freeze()

    with _shared(_frozen, freeze, gc.unfreeze):
        yield
