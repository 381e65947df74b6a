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
