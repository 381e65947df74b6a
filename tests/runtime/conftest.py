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
    """Skip unless Triton's CPU interpreter runs the kernels here (on a GPU machine they run compiled)."""
    from fxrewrite.kernels.triton_utils import HAS_TRITON, interpreter_ready

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if not interpreter_ready():
        pytest.skip("triton runs compiled kernels here (a GPU machine): the CPU interpreter is not in use")
