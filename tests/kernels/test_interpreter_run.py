"""Runs this folder's kernel-vs-reference tests in a subprocess with TRITON_INTERPRET=1 when the
current process imported triton without it (a full-suite run); see conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxrewrite.kernels.triton_utils import HAS_TRITON, interpreter_ready


def test_kernels_under_interpreter():
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if interpreter_ready():
        pytest.skip("the kernel tests run in this process")
    if torch.cuda.is_available():
        pytest.skip("GPU present: the kernels are tested compiled (make gpu-check)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = Path(__file__).parent
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not gpu", str(here)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
