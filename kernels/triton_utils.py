"""Optional triton import and the one launch helper every kernel wrapper uses.

When triton is missing (macOS, no GPU wheels) ``triton.jit`` becomes the identity and
``tl.constexpr`` a placeholder, so the kernel modules still import and their references work.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Iterator

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False
    triton = SimpleNamespace(jit=lambda fn=None, **_: fn if fn is not None else (lambda f: f),
                             next_power_of_2=lambda n: 1 << max(0, int(n) - 1).bit_length(),
                             cdiv=lambda a, b: -(-a // b))
    tl = SimpleNamespace(constexpr=object)

__all__ = ["HAS_TRITON", "triton", "tl", "launch", "next_power_of_2", "interpreter_ready", "watch_jit_compiles",
           "listen_launches"]


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def launch(kernel: Any, grid: tuple[int, ...], device: Any, pdl: bool = False) -> Any:
    """Return ``kernel[grid]``; refuse CPU tensors unless the kernels were built for the interpreter.
    ``pdl``: launch with programmatic dependent launch (``launch_pdl=True``; `fxrewrite.kernels.pdl`).

    triton decides interpreter vs compiler when a function is decorated (its own ``tl.zeros``,
    ``tl.sum``... included), so ``TRITON_INTERPRET=1`` must be set before triton is first imported.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use the *_ref torch functions instead")
    if getattr(device, "type", str(device)) == "cpu" and type(kernel).__name__ != "InterpretedFunction":
        raise RuntimeError("Triton kernels got CPU tensors but triton was imported without "
                           "TRITON_INTERPRET=1; set it before anything imports triton, or use the *_ref functions")
    run = functools.partial(kernel[grid], launch_pdl=True) if pdl else kernel[grid]
    if _LISTENERS:
        return _listened(kernel, run)
    return run


_LISTENERS: list[Any] = []


def _listened(kernel: Any, run: Any) -> Any:
    name = getattr(getattr(kernel, "fn", kernel), "__name__", "?")

    def call(*args, **kwargs):
        for listener in _LISTENERS:
            listener.enter_launch(name)
        try:
            return run(*args, **kwargs)
        finally:
            for listener in _LISTENERS:
                listener.exit_launch(name)

    return call


@contextmanager
def listen_launches(listener: Any) -> Iterator[Any]:
    """Inside the block, every kernel started through `launch` calls ``listener.enter_launch(name)`` before
    it runs and ``listener.exit_launch(name)`` after (a launch counter: `fxrewrite.benchmarks.count_launches`)."""
    _LISTENERS.append(listener)
    try:
        yield listener
    finally:
        _LISTENERS.remove(listener)


def interpreter_ready() -> bool:
    """True when triton was imported under ``TRITON_INTERPRET=1`` (kernels can run on CPU tensors)."""
    return HAS_TRITON and type(tl.zeros).__name__ == "InterpretedFunction"


@contextmanager
def watch_jit_compiles() -> Iterator[list[str]]:
    """Record, inside the block, every Triton kernel specialisation the JIT had to build (a miss of the
    in-memory kernel cache: compiled, or loaded from Triton's disk cache). Yields a list that fills with
    one description per miss (kernel name and argument types, e.g. ``bt_s0: i32`` or ``i32D`` for an int
    specialised on divisibility by 16). Uses ``triton.knobs.runtime.jit_cache_hook`` (triton >= 3.4),
    chaining any hook already set; records nothing under ``TRITON_INTERPRET=1`` (no compilation) or
    without triton. A benchmark's timed run should record none: each one is a JIT stall in the timing."""
    seen: list[str] = []
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if not HAS_TRITON or runtime is None or not hasattr(runtime, "jit_cache_hook"):
        yield seen
        return
    previous = runtime.jit_cache_hook

    def hook(*args, **kwargs):
        seen.append(str(kwargs.get("repr", "?")))
        return previous(*args, **kwargs) if previous is not None else False

    runtime.jit_cache_hook = hook
    try:
        yield seen
    finally:
        runtime.jit_cache_hook = previous
