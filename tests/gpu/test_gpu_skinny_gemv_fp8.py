"""Skinny GEMV on FP8 weights on the GPU: every config at Qwen3-32B / 4B shapes against the dequantized float32
product; the tuner records FP8 choices; the engine's decode (eager and CUDA-graph replay) with the FP8 GEMV
against the FP8 GEMMs. CPU tests: tests/kernels/test_skinny_gemv_fp8.py."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels import fp8_dispatch, gemv_dispatch, gemv_tune
from fxrewrite.kernels.skinny_gemv import configs_for
from fxrewrite.kernels.triton_utils import listen_launches

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
_SHAPES = {"qkv-32b": ("norm", 10240, 5120), "o-32b": ("linear", 5120, 8192), "down-32b": ("silu", 5120, 25600),
           "qkv-4b": ("norm", 6144, 2560), "down-4b": ("silu", 2560, 9728)}


@pytest.fixture(autouse=True)
def _fresh_choices():
    gemv_dispatch.clear()
    yield
    gemv_dispatch.clear()


@pytest.mark.parametrize("fmt", ["fp8", "fp8-channel"])
@pytest.mark.parametrize("shape", list(_SHAPES))
@pytest.mark.parametrize("m", [1, 3, 8])
def test_every_config_matches_the_dequantized_product(shape, m, fmt):
    kind, n, k = _SHAPES[shape]
    w = gemv_tune.scratch_weights(n, k, "cuda", FP8)[0]
    fp8 = {"w_scale": gemv_tune.scratch_scales(n, k, "cuda", fmt == "fp8-channel"), "per_channel": fmt == "fp8-channel"}
    args = gemv_tune.make_inputs(kind, m, k, "cuda", torch.bfloat16, seed=m)
    want = gemv_tune.reference(kind, w, **args, **fp8)
    errors = {c: gemv_tune.max_rel_error(gemv_tune.candidate(kind, w, config=c, **args, **fp8), want)
              for c in configs_for(m, kind, n, fmt=fmt)}
    assert all(e < 2e-2 for e in errors.values()), errors


@pytest.mark.parametrize("fmt", ["fp8", "fp8-channel"])
@pytest.mark.parametrize("shape", ["o-32b", "down-32b", "down-4b"])
@pytest.mark.parametrize("m", [1, 8])
def test_out_residual_epilogue_is_the_torch_add(shape, m, fmt):
    """The closing residual add in the FP8 GEMV's epilogue, bf16: bitwise the same kernel's output plus out_residual
    as torch adds them, at every config."""
    kind, n, k = _SHAPES[shape]
    w = gemv_tune.scratch_weights(n, k, "cuda", FP8)[0]
    fp8 = {"w_scale": gemv_tune.scratch_scales(n, k, "cuda", fmt == "fp8-channel"), "per_channel": fmt == "fp8-channel"}
    args = gemv_tune.make_inputs(kind, m, k, "cuda", torch.bfloat16, seed=m)
    r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(m))
    for config in configs_for(m, kind, n, fmt=fmt):
        plain = gemv_dispatch.run(args["x"], w, None, config, silu_mul=kind == "silu", **fp8)
        got = gemv_dispatch.run(args["x"], w, None, config, silu_mul=kind == "silu", out_residual=r, **fp8)
        assert torch.equal(got, r + plain), config


def test_tuner_records_fp8_choices(monkeypatch):
    monkeypatch.setenv("FXREWRITE_GEMV", "auto")
    timings = gemv_tune.tune({("norm", 6144, 2560, "fp8"), ("silu", 2560, 9728, "fp8-channel")}, "cuda",
                             torch.bfloat16, max_m=2)
    assert set(timings) == {"norm 6144x2560@1 fp8", "norm 6144x2560@2 fp8", "silu 2560x9728@1 fp8-channel",
                            "silu 2560x9728@2 fp8-channel"}
    for times in timings.values():
        assert isinstance(times["cublas"], float), times
        assert any(isinstance(t, float) for name, t in times.items() if name != "cublas"), times
    print(gemv_dispatch.choices(), timings)


class _Names:
    def __init__(self):
        self.names = set()

    def enter_launch(self, name):
        self.names.add(name)

    def exit_launch(self, name):
        pass


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_fp8_decode_with_and_without_gemv(make_llm, monkeypatch, impl):
    from tests.gpu.conftest import decode_batch
    from fxrewrite.runtime.worker.forward_context import forward_context

    monkeypatch.setenv("FXREWRITE_GEMV", "on")
    llm = make_llm(model_impl=impl, quantization="fp8", dtype="bfloat16", max_num_seqs=8, compilation_config=0)
    runner = llm.llm_engine.model_runner
    model = runner.model
    # off: the weight-only FP8 GEMV (fp8_gemv.py, M <= 4) too, so both sides keep bf16 activations
    monkeypatch.setattr(fp8_dispatch, "choose", lambda n, k, m, per_channel=False: "gemv:0")
    for n in (1, 3):
        ids, pos, meta = decode_batch(runner, n, seed=n)
        with torch.inference_mode():
            seen = _Names()
            with forward_context(meta), listen_launches(seen):
                logits_on = model.compute_logits(model(ids, pos).clone())
            replay = runner.graph_runner.run(ids, pos, meta).clone()  # captured with the GEMV
            monkeypatch.setenv("FXREWRITE_GEMV", "off")
            with forward_context(meta):
                hidden_off = model(ids, pos).clone()
                logits_off = model.compute_logits(hidden_off)
            monkeypatch.setenv("FXREWRITE_GEMV", "on")
        assert "_skinny_gemv_fp8_kernel" in seen.names, seen.names
        assert _close(logits_on, logits_off) < 5e-2, f"{n} sequences"
        assert _close(replay, hidden_off) < 5e-2, f"{n} sequences, graph replay"
