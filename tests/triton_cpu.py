"""The Triton CPU-interpreter requirement of kernel tests, one rule for all of them.

On a GPU machine Triton runs compiled kernels (the interpreter is not in use): those tests skip there, the GPU
tests cover the kernels. On a CPU-only Linux x86_64 machine (CI) triton is a dependency and tests/conftest.py sets
TRITON_INTERPRET=1 before triton's import, so a missing triton or an inactive interpreter is a setup fault: the
test fails (a skip would hide ~100 kernel tests). Elsewhere (no triton wheel) the tests skip.
"""

from __future__ import annotations

import platform

import pytest
import torch

from fxrewrite.kernels.triton_utils import HAS_TRITON, interpreter_ready


def require_interpreter() -> None:
    """Skip on a GPU machine or where triton has no wheel; fail on CPU-only Linux x86_64 unless the interpreter runs."""
    if torch.cuda.is_available():
        pytest.skip("a GPU machine: Triton runs compiled kernels here, not the CPU interpreter")
    if not (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")):
        if not HAS_TRITON or not interpreter_ready():
            pytest.skip(f"no Triton interpreter on {platform.system()} {platform.machine()}")
        return
    if not HAS_TRITON:
        pytest.fail("triton is not installed (a dependency on Linux x86_64: `make setup`)")
    if not interpreter_ready():
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set (see tests/conftest.py)")
