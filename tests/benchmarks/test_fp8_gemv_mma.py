"""The tensor-core FP8 GEMV experiment (`benchmarks/fp8_gemv_mma.py`) computes the block-scaled product: its kernel
in the Triton interpreter against the float32 product with the dequantized weight, at two of its configs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fxrewrite.benchmarks.fp8_gemv_mma import gemv_mma
from fxrewrite.kernels.gemv_tune import max_rel_error, scratch_scales
from tests.triton_cpu import require_interpreter


@pytest.mark.parametrize("config", [(16, 128, 2, 4), (32, 256, 2, 4)], ids=str)
def test_mma_gemv_matches_the_dequantized_product(config):
    require_interpreter()
    torch.manual_seed(0)
    n, k = 48, 512  # a partial last tile of rows at 32
    w = torch.randn(n, k).mul(32).to(torch.float8_e4m3fn)
    s = scratch_scales(n, k, "cpu", rows=128)
    x = torch.randn(1, k).to(torch.bfloat16)
    want = F.linear(x.float(), w.float() * s.repeat_interleave(128, dim=1)[:, :k])
    assert max_rel_error(gemv_mma(x, w, s, config), want) < 1e-2
