"""The software-pipelined one-token GEMV on float weights on the GPU (compiled, where triton pipelines its loads):
every config at Qwen3-4B / 32B shapes against F.linear, eagerly and replayed from a CUDA graph; each kind with its
prologue against the unfused kernels + cuBLAS, and with the prologue in its loop ("pipelined-fused"); the tuner
proves and times both at one token. CPU tests:
tests/kernels/test_skinny_gemv_pipelined.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fxrewrite.kernels import gemv_dispatch, gemv_tune
from fxrewrite.kernels.skinny_gemv_pipelined import PIPELINED_CONFIGS, skinny_gemv_pipelined_triton

pytestmark = pytest.mark.gpu

_SHAPES = {"qkv-4b": (6144, 2560), "o-4b": (2560, 4096), "down-4b": (2560, 9728), "o-32b": (5120, 8192),
           "odd": (1000, 3208)}  # odd: a partial row tile and K past the last tile


@pytest.mark.parametrize("shape", list(_SHAPES))
def test_every_config_matches_eager_and_in_a_graph(shape):
    n, k = _SHAPES[shape]
    w = gemv_tune.scratch_weights(n, k, "cuda", torch.bfloat16)[0]
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for config in PIPELINED_CONFIGS:
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        eager = skinny_gemv_pipelined_triton(x, w, bias, config)
        assert gemv_tune.max_rel_error(eager, F.linear(x.float(), w.float(), bias.float())) < 1e-2, config
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = skinny_gemv_pipelined_triton(x, w, bias, config)
        x.copy_(torch.randn_like(x))  # the replay reads the new input
        graph.replay()
        again = skinny_gemv_pipelined_triton(x, w, bias, config)
        torch.testing.assert_close(captured, again, rtol=0, atol=0)


@pytest.mark.parametrize("kind, n, k", [("norm", 6144, 2560), ("linear", 2560, 4096), ("silu", 2560, 9728)])
def test_each_kind_matches_the_unfused_kernels(kind, n, k):
    w = gemv_tune.scratch_weights(n, k, "cuda", torch.bfloat16)[0]
    args = gemv_tune.make_inputs(kind, 1, k, "cuda", torch.bfloat16, seed=1)
    want = gemv_tune.baseline(kind, w, **args)
    for config in gemv_dispatch.pipelined_configs() + gemv_dispatch.fused_pipelined_configs(kind):
        assert gemv_tune.max_rel_error(gemv_tune.candidate(kind, w, config=config, **args), want) < 2e-2, config
        if config[0] == gemv_dispatch.PIPELINED_FUSED:  # one launch, and the same in a CUDA graph
            eager = gemv_tune.candidate(kind, w, config=config, **args)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = gemv_tune.candidate(kind, w, config=config, **args)
            graph.replay()
            torch.testing.assert_close(captured, eager, rtol=0, atol=0)


def test_tuner_times_and_proves_it_at_one_token(monkeypatch):
    monkeypatch.setenv("FXREWRITE_GEMV", "auto")
    gemv_dispatch.clear()
    try:
        timings = gemv_tune.tune({("linear", 2560, 4096), ("silu", 2560, 9728)}, "cuda", torch.bfloat16, max_m=1)
        for key, times in timings.items():
            for tag in (gemv_dispatch.PIPELINED, gemv_dispatch.PIPELINED_FUSED):
                if tag == gemv_dispatch.PIPELINED_FUSED and key.startswith("linear"):
                    continue  # no prologue to fuse
                timed = {name: us for name, us in times.items() if name.split("/")[0] == tag}
                assert len(timed) == len(PIPELINED_CONFIGS), (tag, times)
                assert all(isinstance(us, float) for us in timed.values()), times
            print(key, times)
        print(gemv_dispatch.choices())
    finally:
        gemv_dispatch.clear()
