"""The GEMV benchmarks with the pipelined GEMV's tagged choices, on a CPU (the timings need a GPU): the sweep's
candidate list holds them at M = 1 (and its kernel pre-build can sort them among the skinny configs), and the
decode-chain layer runs a tuner choice of them through `gemv_dispatch.run`."""

from __future__ import annotations

import torch

from fxrewrite.benchmarks import decode_chain, gemv
from fxrewrite.benchmarks.common import load_bench_config
from fxrewrite.kernels import gemv_dispatch, gemv_tune


def test_sweep_candidates_include_the_pipelined_configs_at_one_token():
    kind, n, _ = gemv.projections(load_bench_config("qwen3-4b")["config"])["o_proj"]
    one, two = gemv_tune.candidates(1, kind, n), gemv_tune.candidates(2, kind, n)
    assert set(gemv_dispatch.pipelined_configs()) <= set(one)
    assert not any(gemv_dispatch.is_pipelined(c) for c in two)
    assert sorted(set(one), key=repr)  # the pre-build's ordering of mixed tagged / untagged configs


def test_decode_chain_layer_with_pipelined_choices_matches_unfused(monkeypatch):
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    cfg = {"hidden_size": 64, "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 96}
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = decode_chain.build(cfg, layers=1, context=20, max_model_len=64, device=device, dtype=torch.float32)
    lw = model["layers"][0]
    tagged = gemv_dispatch.pipelined_configs()
    fused = {"qkv_proj": tagged[0], "o_proj": tagged[1], "gate_up_proj": tagged[4], "down_proj": tagged[5]}
    got = decode_chain.layer(model, lw, model["hidden"], model["residual"], fused)
    want = decode_chain.layer(model, lw, model["hidden"], model["residual"], dict.fromkeys(fused))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
