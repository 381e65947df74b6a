"""The software-pipelined one-token FP8 GEMV on the GPU (compiled, where triton pipelines its loads): every config at
Qwen3-32B / 4B shapes against the dequantized float32 product (per-channel and block-scaled weights), eagerly and
replayed from a CUDA graph; the tuner proves and times it at one token. CPU tests:
tests/kernels/test_fp8_gemv_pipelined.py."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels import fp8_dispatch, fp8_tune, gemv_tune
from fxrewrite.kernels.fp8_gemv import fp8_weight_only_gemv_ref
from fxrewrite.kernels.fp8_gemv_pipelined import PIPELINED_CONFIGS, fp8_gemv_pipelined_triton

pytestmark = pytest.mark.gpu

_SHAPES = {"qkv-32b": (10240, 5120), "o-32b": (5120, 8192), "down-32b": (5120, 25600), "o-4b": (2560, 4096),
           "odd": (1000, 3200)}  # odd: a partial row tile and K past the last 512-column tile


@pytest.mark.parametrize("form", ["channel", "block", "shared"])  # shared: one scale row per 128-row block
@pytest.mark.parametrize("shape", list(_SHAPES))
def test_every_config_matches_eager_and_in_a_graph(shape, form):
    n, k = _SHAPES[shape]
    per_channel, scale_rows = form == "channel", 128 if form == "shared" else 1
    w = gemv_tune.scratch_weights(n, k, "cuda", torch.float8_e4m3fn)[0]
    scales = gemv_tune.scratch_scales(n, k, "cuda", per_channel)
    if form == "shared":
        scales = scales[::128].repeat_interleave(128, dim=0)[:n].t().contiguous().t()
    for config in PIPELINED_CONFIGS:
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        want = fp8_weight_only_gemv_ref(x, w, scales, out_dtype=torch.float32)
        eager = fp8_gemv_pipelined_triton(x, w, scales, config, per_channel, scale_rows)
        assert gemv_tune.max_rel_error(eager, want) < 1e-2, config
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fp8_gemv_pipelined_triton(x, w, scales, config, per_channel, scale_rows)
        x.copy_(torch.randn_like(x))  # the replay reads the new input
        graph.replay()
        again = fp8_gemv_pipelined_triton(x, w, scales, config, per_channel, scale_rows)
        torch.testing.assert_close(captured, again, rtol=0, atol=0)


def test_tuner_times_and_proves_it_at_one_token():
    fp8_dispatch.clear()
    try:
        timings = fp8_tune.tune({(5120, 8192, True), (5120, 8192)}, torch.device("cuda"), torch.bfloat16, buckets=(1,))
        for key in ((5120, 8192, 1, True), (5120, 8192, 1)):  # per-channel; block-scaled (shared scales)
            one = timings[key]
            pipelined = {name: us for name, us in one.items() if name.startswith(fp8_dispatch.PIPELINED)}
            assert len(pipelined) == len(PIPELINED_CONFIGS) and all(isinstance(us, float) for us in pipelined.values()), one
            print(key, one)
    finally:
        fp8_dispatch.clear()

