"""The register-prefetch decode experiment (`fxrewrite.benchmarks.decode_prefetch`) computes paged decode attention:
against the reference over the dequantized cache, one split and several, 16-bit and e4m3 caches (CPU interpreter)."""

from __future__ import annotations

import pytest
import torch

import fxrewrite.benchmarks.kernels as kernel_bench
from fxrewrite.benchmarks.decode_prefetch import decode_prefetch
from fxrewrite.kernels.paged_attention import paged_attention_ref
from tests.benchmarks.test_bench_entry_points import _KERNEL_GLOBALS
from tests.triton_cpu import require_interpreter


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_decode_prefetch_matches_reference(monkeypatch, dtype):
    require_interpreter()
    for name in _KERNEL_GLOBALS:
        monkeypatch.setattr(kernel_bench, name, getattr(kernel_bench, name))
    kernel_bench.use_cpu_smoke_sizes()
    torch.manual_seed(0)
    # 40 / 7 keys: one split, a partial tile; 300: several splits and the merge
    args, _ = kernel_bench._paged_batch([(39, 1), (6, 1), (299, 1)])
    case = (args[0], args[1].to(dtype), args[2].to(dtype), *args[3:])
    scale = kernel_bench.HEAD_DIM ** -0.5
    want = paged_attention_ref(case[0], case[1].to(torch.float16), case[2].to(torch.float16), *args[3:], scale)
    for bt_ahead in (False, True):
        out = decode_prefetch(*case, scale, block_n=16, bt_ahead=bt_ahead)
        err = ((out.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1e-3, (bt_ahead, err)
