"""The one-token FP8 gate_up GEMV with SiLU-and-mul in its epilogue on the GPU: every pipelined config at Qwen3-32B /
4B gate_up shapes (and an odd one) against the reference and against the unfused pair it replaces (the pipelined
GEMV then the SiLU-and-mul kernel), eagerly and replayed from a CUDA graph. CPU tests:
tests/kernels/test_fp8_gemv_gated.py."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels import gemv_tune
from fxrewrite.kernels.activation import silu_and_mul
from fxrewrite.kernels.fp8_gemv_gated import fp8_gemv_gated_ref, fp8_gemv_gated_triton, supports
from fxrewrite.kernels.fp8_gemv_pipelined import PIPELINED_CONFIGS, fp8_gemv_pipelined_triton

pytestmark = pytest.mark.gpu

_SHAPES = {"gate_up-32b": (25600, 5120), "gate_up-4b": (9728, 2560), "odd": (1000, 3200)}  # (I, K)


@pytest.mark.parametrize("form", ["channel", "shared"])
@pytest.mark.parametrize("shape", list(_SHAPES))
def test_every_config_matches_the_unfused_pair_eager_and_in_a_graph(shape, form):
    inter, k = _SHAPES[shape]
    per_channel = form == "channel"
    rows = 1 if per_channel else (128 if inter % 128 == 0 else 8)
    w = gemv_tune.scratch_weights(2 * inter, k, "cuda", torch.float8_e4m3fn)[0]
    scales = gemv_tune.scratch_scales(2 * inter, k, "cuda", per_channel, rows)
    ran = 0
    for config in PIPELINED_CONFIGS:
        if not supports(config, inter, per_channel, rows):
            continue
        ran += 1
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        eager = fp8_gemv_gated_triton(x, w, scales, config, per_channel, rows)
        assert gemv_tune.max_rel_error(eager, fp8_gemv_gated_ref(x, w, scales)) < 2e-2, config
        unfused = silu_and_mul(fp8_gemv_pipelined_triton(x, w, scales, config, per_channel, rows))
        assert gemv_tune.max_rel_error(eager, unfused) < 2e-2, config
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fp8_gemv_gated_triton(x, w, scales, config, per_channel, rows)
        x.copy_(torch.randn_like(x))  # the replay reads the new input
        graph.replay()
        again = fp8_gemv_gated_triton(x, w, scales, config, per_channel, rows)
        torch.testing.assert_close(captured, again, rtol=0, atol=0)
    assert ran >= 4
