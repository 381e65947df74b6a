"""Engine tests run many small ops: one intra-op thread avoids spin-waiting on a shared 2-core machine."""

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def interpret():
    """Triton's CPU interpreter runs the kernels here (`tests.triton_cpu.require_interpreter`: skip on a GPU
    machine, fail on a CPU-only Linux machine without it)."""
    from tests.triton_cpu import require_interpreter

    require_interpreter()
