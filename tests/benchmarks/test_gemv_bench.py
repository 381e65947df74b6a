"""The skinny-GEMV benchmark's shapes and argument handling on a CPU (the timings need a GPU)."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.benchmarks import gemv
from fxrewrite.benchmarks.common import load_bench_config


def test_projections_are_the_decoder_layer_shapes():
    assert gemv.projections(load_bench_config("qwen3-4b")["config"]) == {
        "qkv_proj": ("norm", 6144, 2560), "o_proj": ("linear", 2560, 4096),
        "gate_up_proj": ("norm", 19456, 2560), "down_proj": ("silu", 2560, 9728)}
    assert gemv.projections(load_bench_config("qwen3-32b")["config"])["down_proj"] == ("silu", 5120, 25600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_main_needs_a_gpu(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        gemv.main(["--out", str(tmp_path)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_decode_chain_needs_a_gpu(tmp_path):
    from fxrewrite.benchmarks import decode_chain

    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        decode_chain.main(["--out", str(tmp_path)])


def test_decode_chain_layer_with_gemvs_matches_unfused(monkeypatch):
    """The microbenchmark's layer, GEMV configs (split-K down / o_proj) against the unfused kernels + F.linear
    (float32, tiny Qwen3 shapes; the Triton interpreter on a CPU)."""
    from fxrewrite.benchmarks import decode_chain
    from fxrewrite.kernels.skinny_gemv import SPLIT_CONFIGS, configs_for

    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    cfg = {"hidden_size": 64, "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 96}
    torch.manual_seed(0)
    model = decode_chain.build(cfg, layers=1, context=20, max_model_len=64, device=device, dtype=torch.float32)
    lw = model["layers"][0]
    fused = {"qkv_proj": configs_for(1)[0], "o_proj": SPLIT_CONFIGS[1][2], "gate_up_proj": configs_for(1)[1],
             "down_proj": SPLIT_CONFIGS[1][0]}
    got = decode_chain.layer(model, lw, model["hidden"], model["residual"], fused)
    want = decode_chain.layer(model, lw, model["hidden"], model["residual"], dict.fromkeys(fused))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
