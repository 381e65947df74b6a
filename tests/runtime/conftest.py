"""Engine tests run many small ops: one intra-op thread avoids spin-waiting on a shared 2-core machine."""

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
