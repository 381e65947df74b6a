"""Optional triton import and the one launch helper every kernel wrapper uses.

When triton is missing (macOS, no GPU wheels) ``triton.jit`` becomes the identity and
``tl.constexpr`` a placeholder, so the kernel modules still import and their references work.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

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

__all__ = ["HAS_TRITON", "triton", "tl", "launch", "next_power_of_2", "interpreter_ready"]


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def launch(kernel: Any, grid: tuple[int, ...], device: Any) -> Any:
    """Return ``kernel[grid]``; refuse CPU tensors unless the kernels were built for the interpreter.

    triton decides interpreter vs compiler when a function is decorated (its own ``tl.zeros``,
    ``tl.sum``... included), so ``TRITON_INTERPRET=1`` must be set before triton is first imported.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use the *_ref torch functions instead")
    if getattr(device, "type", str(device)) == "cpu" and type(kernel).__name__ != "InterpretedFunction":
        raise RuntimeError("Triton kernels got CPU tensors but triton was imported without "
                           "TRITON_INTERPRET=1; set it before anything imports triton, or use the *_ref functions")
    return kernel[grid]


def interpreter_ready() -> bool:
    """True when triton was imported under ``TRITON_INTERPRET=1`` (kernels can run on CPU tensors)."""
    return HAS_TRITON and type(tl.zeros).__name__ == "InterpretedFunction"
