"""Python's cyclic garbage collector around the engine: fewer young-generation passes while it steps, and the
startup heap left out of full collections while a server runs."""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

__all__ = ["fewer_gc_passes", "frozen_startup_heap"]

# The collector's settings are the process's: blocks may overlap (two servers in one process, LLM.generate in two
# threads) and end in any order, so each setting is restored when the last block using it ends.
_lock = threading.Lock()
_young = {"users": 0, "saved": None}
_frozen = {"users": 0}


@contextmanager
def fewer_gc_passes(gen0_threshold: int = 50_000):
    """Python's cyclic GC collects its young generation every 700 net allocations, and every tenth of those
    passes also walks the middle one; an engine step with a thousand sequences allocates several objects
    per sequence (samples, logprob dicts, scheduled entries), so passes ran every step, and the walks of
    the sequences' ever-growing logprob dicts cost 10-20% of the host time of a 1024-sequence decode step
    (CPU profile of the engine loop, thread time, this session). During the run the young threshold is
    raised to `gen0_threshold` (never lowered), and restored when the last such block ends; nothing else
    changes."""
    with _lock:
        now = gc.get_threshold()
        if _young["users"] == 0:
            _young["saved"] = now
        _young["users"] += 1
        gc.set_threshold(max(now[0], gen0_threshold), *now[1:])
    try:
        yield
    finally:
        with _lock:
            _young["users"] -= 1
            if _young["users"] == 0:
                gc.set_threshold(*_young["saved"])


@contextmanager
def frozen_startup_heap():
    """While the block runs, the objects alive at its start (modules, parameters, tokenizer, compiled code: a loaded
    Qwen3-0.6B engine holds ~400k tracked objects, whose full collection took 180 ms on a 2-core CPU) are moved to
    the collector's permanent generation (`gc.freeze`), so full collections walk only what was made since; on exit
    they go back (`gc.unfreeze`) and can be collected again. vLLM's API server and engine core freeze their
    startup heap the same way. A collection first, so that garbage made at startup is not kept for the block's
    lifetime. Meant for a process's long-lived engines (`fxrewrite serve`); overlapping blocks unfreeze when the last
    one ends."""
    with _lock:
        gc.collect()
        gc.freeze()  # a block starting inside another freezes what was made since, its own engine included
        _frozen["users"] += 1
    try:
        yield
    finally:
        with _lock:
            _frozen["users"] -= 1
            if _frozen["users"] == 0:
                gc.unfreeze()
