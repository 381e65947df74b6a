"""Skinny GEMV on the GPU: the kernel at Qwen3-4B shapes against the unfused kernels + cuBLAS, the load-time
tuner, and decode logits of the native and rewritten (`after`) models with and without it (eager and CUDA-graph
replay). CPU tests: tests/kernels/test_skinny_gemv.py, tests/runtime/test_skinny_gemv_decode.py."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.benchmarks.common import load_bench_config
from fxrewrite.benchmarks.gemv import projections
from fxrewrite.kernels import gemv_dispatch, gemv_tune
from fxrewrite.kernels.skinny_gemv import configs_for
from fxrewrite.kernels.triton_utils import listen_launches

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda():
    return torch.device("cuda")


@pytest.fixture(autouse=True)
def _fresh_choices():
    gemv_dispatch.clear()
    yield
    gemv_dispatch.clear()


@pytest.mark.parametrize("proj", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_kernel_at_qwen3_4b_shapes(cuda, proj, m):
    kind, n, k = projections(load_bench_config("qwen3-4b")["config"])[proj]
    w = gemv_tune.scratch_weights(n, k, cuda, torch.bfloat16)[0]
    args = gemv_tune.make_inputs(kind, m, k, cuda, torch.bfloat16, seed=m)
    want = gemv_tune.baseline(kind, w, **args)
    for config in configs_for(m, kind):
        got = gemv_tune.candidate(kind, w, config=config, **args)
        assert gemv_tune.max_rel_error(got, want) < 2e-2, f"config {config}"
    if kind == "norm":  # the new residual: one rounding of x + residual, as the RMSNorm kernel's
        from fxrewrite.kernels.skinny_gemv import skinny_gemv_triton

        _, res = skinny_gemv_triton(args["x"], w, norm_weight=args["norm_weight"], residual=args["residual"])
        assert torch.equal(res, args["x"] + args["residual"])


def test_tuner_records_a_choice_per_bucket(cuda, monkeypatch):
    monkeypatch.setenv("FXREWRITE_GEMV", "auto")
    timings = gemv_tune.tune({("norm", 6144, 2560), ("silu", 2560, 9728)}, cuda, torch.bfloat16, max_m=2)
    assert set(timings) == {"norm 6144x2560@1", "norm 6144x2560@2", "silu 2560x9728@1", "silu 2560x9728@2"}
    for times in timings.values():
        assert isinstance(times["cublas"], float)
        assert any(isinstance(t, float) for name, t in times.items() if name != "cublas"), times
    assert len(gemv_dispatch.choices()) == 4


class _Names:
    def __init__(self):
        self.names = set()

    def enter_launch(self, name):
        self.names.add(name)

    def exit_launch(self, name):
        pass


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_decode_logits_with_and_without_gemv(make_llm, monkeypatch, impl, dtype, tol):
    from tests.gpu.conftest import decode_batch
    from fxrewrite.runtime.worker.forward_context import forward_context

    monkeypatch.setenv("FXREWRITE_GEMV", "on")  # at load: the after model's plain linears are adopted too
    llm = make_llm(model_impl=impl, fusion=True, dtype=dtype, max_num_seqs=8, compilation_config=0)
    runner = llm.llm_engine.model_runner
    model = runner.model
    for n in (1, 3, 8):
        ids, pos, meta = decode_batch(runner, n, seed=n)
        with torch.inference_mode():
            seen = _Names()
            with forward_context(meta), listen_launches(seen):
                hidden_on = model(ids, pos).clone()
                logits_on = model.compute_logits(hidden_on)
            replay = runner.graph_runner.run(ids, pos, meta).clone()  # captured with the GEMV
            monkeypatch.setenv("FXREWRITE_GEMV", "off")
            with forward_context(meta):
                hidden_off = model(ids, pos).clone()
                logits_off = model.compute_logits(hidden_off)
            monkeypatch.setenv("FXREWRITE_GEMV", "on")
        assert "_skinny_gemv_kernel" in seen.names
        assert _close(logits_on, logits_off) < tol, f"{n} sequences"
        assert _close(replay, hidden_off) < tol, f"{n} sequences, graph replay"
        if dtype == "float32":
            assert torch.equal(logits_on.argmax(-1), logits_off.argmax(-1))


def test_engine_load_tunes_its_shapes(make_llm, monkeypatch):
    monkeypatch.setenv("FXREWRITE_GEMV", "auto")
    make_llm(model_impl="native", dtype="bfloat16", max_num_seqs=1, compilation_config=0)
    kinds = {key.split(" ")[0] for key in gemv_dispatch.choices()}
    assert kinds == {"norm", "linear", "silu"} and all(key.endswith("@1") for key in gemv_dispatch.choices())


@pytest.mark.parametrize("m", [1, 2, 8])
def test_out_residual_epilogue_is_the_torch_add(cuda, m):
    """At Qwen3-4B's down_proj shape, in bf16, every skinny config (split-K included) and the pipelined GEMV with
    the epilogue give exactly ``out_residual + out`` of the same kernel's output (the rewritten layers' closing add)."""
    from fxrewrite.kernels.skinny_gemv import skinny_gemv_triton
    from fxrewrite.kernels.skinny_gemv_pipelined import PIPELINED_CONFIGS, skinny_gemv_pipelined_triton

    _, n, k = projections(load_bench_config("qwen3-4b")["config"])["down_proj"]
    w = gemv_tune.scratch_weights(n, k, cuda, torch.bfloat16)[0]
    g = torch.Generator(device=cuda).manual_seed(m)
    x = torch.randn(m, k, device=cuda, generator=g).bfloat16()
    r = torch.randn(m, n, device=cuda, generator=g).bfloat16()
    for config in configs_for(m, "linear", n):
        assert torch.equal(skinny_gemv_triton(x, w, out_residual=r, config=config),
                           r + skinny_gemv_triton(x, w, config=config)), config
    if m == 1:
        for config in PIPELINED_CONFIGS:
            assert torch.equal(skinny_gemv_pipelined_triton(x, w, None, config, out_residual=r),
                               r + skinny_gemv_pipelined_triton(x, w, None, config)), config


def test_after_engine_load_tunes_the_folded_mlp(make_llm, monkeypatch):
    """The rewritten model's folded MLP: gate_up_proj is timed as the "norm" kind it is called with."""
    monkeypatch.setenv("FXREWRITE_GEMV", "auto")
    llm = make_llm(model_impl="transformers", fusion=True, dtype="bfloat16", max_num_seqs=1, compilation_config=0)
    gate_up = next(m for n, m in llm.llm_engine.model_runner.model.named_modules() if n.endswith("mlp.gate_up_proj"))
    assert gate_up.gemv_prologue == "norm"
    assert any(key.startswith(f"norm {gate_up.weight.shape[0]}x") for key in gemv_dispatch.choices())
