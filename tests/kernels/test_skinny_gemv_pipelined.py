"""The software-pipelined one-token GEMV on float weights (kernels/skinny_gemv_pipelined.py) against F.linear and
the unfused prologues through the Triton interpreter, float32 and bf16; its place in the GEMV dispatch (a tagged
choice at bucket 1 that `run` honours for every kind) and the load-time tuner (a proven candidate, recorded when
fastest); its sm90 PTX (the weight tiles are cp.async copies). Its speed: `python -m fxrewrite.benchmarks.gemv`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxrewrite.kernels import gemv_dispatch, gemv_tune
from fxrewrite.kernels import skinny_gemv_pipelined as skinny_gemv_pipelined_module
from fxrewrite.kernels.rms_norm import rms_norm_ref
from fxrewrite.kernels.skinny_gemv import configs_for, skinny_gemv_ref
from fxrewrite.kernels.skinny_gemv_pipelined import (PIPELINED_CONFIGS, skinny_gemv_pipelined,
                                                     skinny_gemv_pipelined_fused, skinny_gemv_pipelined_ref,
                                                     skinny_gemv_pipelined_triton)
from fxrewrite.kernels.triton_utils import listen_launches
from fxrewrite.layers.activation import SiluAndMul
from fxrewrite.layers.layernorm import RMSNorm
from fxrewrite.layers.linear import QKVParallelLinear, RowParallelLinear

_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
_KERNEL = "_skinny_gemv_pipelined_kernel"


def _operands(n: int, k: int, dtype, seed: int, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g)
    w = torch.randn(n, k, generator=g).div(k ** 0.5)
    b = torch.randn(n, generator=g) if bias else None
    return x.to(dtype), w.to(dtype), b.to(dtype) if bias else None


def _close(got, want, dtype) -> None:
    """Within the dtype's tolerance, relative to the largest output (bf16: one rounding of the output)."""
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=_TOL[dtype], atol=_TOL[dtype] * scale)


def _interpretable_norm(monkeypatch, dtype) -> None:
    """bf16: the RMSNorm prologue runs its torch reference. The interpreter's bf16 add in `rms_norm_kernel`'s
    residual path gives NaN (numpy has no bf16; the GPU's add is fine, and tests/kernels/test_rms_norm.py checks
    that kernel in float32); the GEMV after it still runs in the interpreter."""
    if dtype == torch.bfloat16:
        monkeypatch.setattr(skinny_gemv_pipelined_module, "rms_norm", rms_norm_ref)


def _same_residual(got, want, dtype) -> None:
    """The new residual: one rounding of x + residual (the interpreter rounds bf16 toward zero, the GPU and torch
    to nearest: one bf16 step apart at most)."""
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2 if dtype == torch.bfloat16 else 0, atol=0)


class _Launches:
    def __init__(self):
        self.names: list[str] = []

    def enter_launch(self, name):
        self.names.append(name)

    def exit_launch(self, name):
        pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("n, k", [(20, 320), (7, 600), (33, 512)])  # partial row tiles; K past the last tile
@pytest.mark.parametrize("config", [PIPELINED_CONFIGS[0], PIPELINED_CONFIGS[4], (4, 128, 2, 4)], ids=str)
def test_matches_linear(interpret, dtype, bias, n, k, config):
    x, w, b = _operands(n, k, dtype, seed=n + k, bias=bias)
    want = skinny_gemv_pipelined_ref(x.float(), w.float(), b.float() if bias else None)  # exact float32 product
    got = skinny_gemv_pipelined_triton(x, w, b, config)
    assert got.dtype == dtype and got.shape == (1, n)
    _close(got, want, dtype)


def test_every_config(interpret):
    x, w, b = _operands(21, 1100, torch.float32, seed=3)
    for config in PIPELINED_CONFIGS:
        _close(skinny_gemv_pipelined_triton(x, w, b, config), skinny_gemv_pipelined_ref(x, w, b), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("prologue", ["norm", "norm_res", "silu"])
def test_prologue_then_gemv_matches_unfused_ref(interpret, monkeypatch, dtype, prologue):
    """The prologue's own kernel (Triton: FXREWRITE_TRITON=1), then the pipelined GEMV, against the unfused ops."""
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    _interpretable_norm(monkeypatch, dtype)
    g = torch.Generator().manual_seed(7)
    k, n = 192, 13
    x, w, b = _operands(n, 2 * k if prologue == "silu" else k, dtype, seed=8)
    w = w[:, :k].contiguous()
    args = {"silu_mul": True} if prologue == "silu" else \
        {"norm_weight": torch.rand(k, generator=g).add(0.5).to(dtype), "eps": 1e-5}
    if prologue == "norm_res":
        args["residual"] = torch.randn(1, k, generator=g).to(dtype)
    got = skinny_gemv_pipelined(x, w, b, config=PIPELINED_CONFIGS[1], **args)
    want = skinny_gemv_ref(x, w, b, **args)
    if prologue == "norm_res":
        _same_residual(got[1], want[1], dtype)
        got, want = got[0], want[0]
    _close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("prologue", ["norm", "norm_res", "silu"])
@pytest.mark.parametrize("k, config", [(192, PIPELINED_CONFIGS[1]), (600, PIPELINED_CONFIGS[4])], ids=str)
def test_fused_prologue_matches_unfused_ref(interpret, dtype, prologue, k, config):
    """The prologue inside the pipelined loop (one launch) against the unfused ops: an RMSNorm's statistics over all
    of K (K past the last tile at 600), the new residual written once, silu(gate) * up rounded as its kernel stores
    it; with and without bias."""
    g = torch.Generator().manual_seed(k)
    n = 13
    x, w, b = _operands(n, 2 * k if prologue == "silu" else k, dtype, seed=k + 1)
    w = w[:, :k].contiguous()
    args = {"silu_mul": True} if prologue == "silu" else \
        {"norm_weight": torch.rand(k, generator=g).add(0.5).to(dtype), "eps": 1e-5}
    if prologue == "norm_res":
        args["residual"] = torch.randn(1, k, generator=g).to(dtype)
    for bias in (b, None):
        with listen_launches(_Launches()) as seen:
            got = skinny_gemv_pipelined_fused(x, w, bias, config=config, **args)
        assert seen.names == [_KERNEL], seen.names
        want = skinny_gemv_ref(x.float(), w.float(), None if bias is None else bias.float(),
                               **{a: v.float() if torch.is_tensor(v) else v for a, v in args.items()})
        if prologue == "norm_res":
            _same_residual(got[1], want[1], dtype)
            got, want = got[0], want[0]
        assert got.dtype == dtype and got.shape == (1, n)
        _close(got, want, dtype)


def test_fused_refuses_what_it_cannot_run():
    x, w, _ = _operands(8, 256, torch.float32, seed=1, bias=False)
    with pytest.raises(ValueError, match=r"expected \[M, 512\]"):
        skinny_gemv_pipelined_fused(x, w, silu_mul=True)
    with pytest.raises(ValueError, match="exclusive"):
        skinny_gemv_pipelined_fused(torch.randn(1, 512), w, silu_mul=True, norm_weight=torch.ones(256))
    with pytest.raises(ValueError, match="needs norm_weight"):
        skinny_gemv_pipelined_fused(x, w, residual=torch.randn(1, 256))
    with pytest.raises(ValueError, match=r"x \[1, K\]"):
        skinny_gemv_pipelined_fused(torch.randn(2, 256), w, norm_weight=torch.ones(256))
    for bad in (torch.ones(255), torch.ones(512)[::2]):  # a wrong length or stride was read out of bounds / wrong
        with pytest.raises(ValueError, match="norm_weight .* expected a contiguous \\(256,\\)"):
            skinny_gemv_pipelined_fused(x, w, norm_weight=bad)


def test_refuses_what_it_cannot_run():
    x, w, _ = _operands(8, 256, torch.float32, seed=1, bias=False)
    with pytest.raises(ValueError, match=r"x \[1, K\]"):
        skinny_gemv_pipelined_triton(torch.randn(2, 256), w)
    with pytest.raises(ValueError, match="one float dtype"):
        skinny_gemv_pipelined_triton(x.bfloat16(), w)
    with pytest.raises(ValueError, match=r"bias \(4,\)"):
        skinny_gemv_pipelined_triton(x, w, torch.zeros(4))
    with pytest.raises(ValueError, match="powers of two"):
        skinny_gemv_pipelined_triton(x, w, config=(8, 192, 3, 4))
    with pytest.raises(ValueError, match=r"expected \[M, 512\]"):
        skinny_gemv_pipelined(x, w, silu_mul=True)


def test_choices_are_tagged_and_round_trip(monkeypatch):
    """A pipelined choice keeps its tag through record / choose / choices / parse; the skinny ones stay untagged;
    a tagged choice is refused where it cannot run (bucket > 1, FP8 formats, malformed)."""
    monkeypatch.setenv("FXREWRITE_GEMV", "auto")
    gemv_dispatch.clear()
    try:
        tagged = gemv_dispatch.pipelined_configs()[2]
        assert tagged == ("pipelined", *PIPELINED_CONFIGS[2]) and gemv_dispatch.is_pipelined(tagged)
        gemv_dispatch.record("silu", 64, 32, 1, tagged)
        gemv_dispatch.record("linear", 64, 32, 1, (4, 512, 2))
        gemv_dispatch.record("norm", 64, 32, 1, None)
        assert gemv_dispatch.choose("silu", 64, 32, 1) == tagged
        text = gemv_dispatch.choices()
        assert text == {"linear 64x32@1": "4/512/2", "norm 64x32@1": "cublas", "silu 64x32@1": "pipelined/8/256/3/4"}
        assert [gemv_dispatch.parse(t) for t in text.values()] == [(4, 512, 2), None, tagged]
        for bucket, fmt, config in ((2, "float", tagged), (1, "fp8", tagged), (1, "float", ("pipelined", 8, 256)),
                                    (1, "float", ("other", 8, 256, 3, 4))):
            with pytest.raises(ValueError, match="a tagged choice is"):
                gemv_dispatch.record("linear", 64, 32, bucket, config, fmt)
        for bad in ("pipelined/8/x/3/4", "pipelined/8/256/3", "4/512"):
            with pytest.raises(ValueError, match="is not 'cublas'"):
                gemv_dispatch.parse(bad)
        monkeypatch.setenv("FXREWRITE_GEMV", "off")
        assert gemv_dispatch.choose("silu", 64, 32, 1) is None  # off wins over a recorded choice
        monkeypatch.setenv("FXREWRITE_GEMV", "on")
        assert gemv_dispatch.choose("silu", 64, 32, 1) == tagged  # on: a recorded choice still wins
        assert gemv_dispatch.choose("silu", 64, 48, 1) == configs_for(1)[0]  # untuned: the first skinny config
    finally:
        gemv_dispatch.clear()


def _layers(dtype, choice):
    torch.manual_seed(0)
    qkv = QKVParallelLinear(64, 8, 2, 1, bias=True, params_dtype=dtype)
    down = RowParallelLinear(48, 16, bias=True, params_dtype=dtype)
    norm = RMSNorm(64, 1e-6, dtype=dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    for kind, n, k in (("norm", 32, 64), ("silu", 16, 48), ("linear", 16, 48)):
        gemv_dispatch.record(kind, n, k, 1, choice)
    return qkv, down, norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layers_run_a_recorded_pipelined_choice(interpret, monkeypatch, dtype):
    """Recorded for every kind at bucket 1, the layers' decode calls launch the pipelined kernel (and not the
    skinny one) and match their unfused forms; two tokens (bucket 2, untuned) keep cuBLAS."""
    gemv_dispatch.clear()
    _interpretable_norm(monkeypatch, dtype)
    x, res, gate_up = torch.randn(1, 64).to(dtype), torch.randn(1, 64).to(dtype), torch.randn(1, 96).to(dtype)

    def calls():
        return [*qkv.norm_forward(x, norm, res), qkv.norm_forward(x, norm)[0],
                down.silu_forward(gate_up, SiluAndMul()), down(gate_up[:, :48])]
    try:
        qkv, down, norm = _layers(dtype, gemv_dispatch.pipelined_configs()[0])
        with torch.no_grad():
            want = calls()  # CPU without FXREWRITE_TRITON: the plain ops
            monkeypatch.setenv("FXREWRITE_TRITON", "1")
            monkeypatch.setenv("FXREWRITE_GEMV", "auto")
            with listen_launches(_Launches()) as seen:
                got = calls()
            assert seen.names.count(_KERNEL) == 4 and "_skinny_gemv_kernel" not in seen.names, seen.names
            with listen_launches(_Launches()) as seen:
                down(torch.randn(2, 48).to(dtype))
            assert _KERNEL not in seen.names
    finally:
        gemv_dispatch.clear()
    _same_residual(got.pop(1), want.pop(1), dtype)
    for g, w in zip(got, want):
        _close(g, w, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tag", ["pipelined-fused", "unfused"])
def test_layers_run_a_recorded_prologue_choice(interpret, monkeypatch, dtype, tag):
    """For "norm" / "silu" (the choice refused for "linear", which has no prologue; round-tripped through choices /
    parse): ("pipelined-fused", config) runs one launch of the pipelined kernel per call, no RMSNorm or SiLU-and-mul
    kernel; ("unfused", skinny config) the prologue's own kernel, then the skinny GEMV without a prologue (at
    Qwen3-32B's K the per-program prologue cost more than the launch). Both give the unfused ops' results."""
    gemv_dispatch.clear()
    if tag == "unfused":
        _interpretable_norm(monkeypatch, dtype)
    x, res, gate_up = torch.randn(1, 64).to(dtype), torch.randn(1, 64).to(dtype), torch.randn(1, 96).to(dtype)
    choice = (gemv_dispatch.fused_pipelined_configs("norm")[0] if tag == "pipelined-fused"
              else ("unfused", *configs_for(1, "linear")[0]))
    assert gemv_dispatch.fused_pipelined_configs("linear") == ()

    def calls():
        return [*qkv.norm_forward(x, norm, res), qkv.norm_forward(x, norm)[0], down.silu_forward(gate_up, SiluAndMul())]
    try:
        torch.manual_seed(0)
        qkv = QKVParallelLinear(64, 8, 2, 1, bias=True, params_dtype=dtype)
        down = RowParallelLinear(48, 16, bias=True, params_dtype=dtype)
        norm = RMSNorm(64, 1e-6, dtype=dtype)
        norm.weight.data.uniform_(0.5, 1.5)
        gemv_dispatch.record("norm", 32, 64, 1, choice)
        gemv_dispatch.record("silu", 16, 48, 1, choice)
        assert gemv_dispatch.parse(gemv_dispatch.choices()["silu 16x48@1"]) == choice
        with torch.no_grad():
            want = calls()
            monkeypatch.setenv("FXREWRITE_TRITON", "1")
            monkeypatch.setenv("FXREWRITE_GEMV", "auto")
            with listen_launches(_Launches()) as seen:
                got = calls()
        if tag == "pipelined-fused":
            assert seen.names == [_KERNEL] * 3, seen.names
        else:
            assert seen.names.count("_skinny_gemv_kernel") == 3 and _KERNEL not in seen.names, seen.names
            assert "_act_and_mul_kernel" in seen.names
    finally:
        gemv_dispatch.clear()
    with pytest.raises(ValueError, match="a tagged choice is"):
        gemv_dispatch.record("linear", 16, 48, 1, choice)  # no prologue to take out
    _same_residual(got.pop(1), want.pop(1), dtype)
    for g, w in zip(got, want):
        _close(g, w, dtype)


def test_run_refuses_a_pipelined_choice_on_fp8():
    w = torch.zeros(8, 128).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="float-weight GEMV"):
        gemv_dispatch.run(torch.zeros(1, 128), w, None, gemv_dispatch.pipelined_configs()[0],
                          w_scale=torch.ones(8, 1))


def test_candidates_at_one_token_on_float_weights_only():
    tagged = gemv_dispatch.pipelined_configs()
    unfused = tuple(("unfused", *c) for c in configs_for(1, "linear", 6144))
    assert unfused and gemv_dispatch.unfused_configs("norm", 6144) == unfused
    fused = tuple(("pipelined-fused", *c) for c in PIPELINED_CONFIGS)
    assert gemv_tune.candidates(1, "norm", 6144) == configs_for(1, "norm", 6144) + tagged + fused + unfused
    assert gemv_tune.candidates(1, "linear", 2560) == configs_for(1, "linear", 2560) + tagged
    assert gemv_tune.candidates(2, "linear", 2560) == configs_for(2, "linear", 2560)
    assert gemv_tune.candidates(1, "silu", 2560, "fp8") == configs_for(1, "silu", 2560, fmt="fp8")


@pytest.mark.parametrize("kind", ["linear", "norm", "silu"])
def test_tuner_records_the_fastest_proven_pipelined_config(interpret, monkeypatch, kind):
    """Timings faked (no GPU): the fastest pipelined config computes garbage and is never chosen; the next fastest
    (pipelined) beats the skinny configs and cuBLAS and is recorded with its tag; it runs through `run`."""
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    tagged = gemv_dispatch.pipelined_configs()
    fast, wrong = tagged[3], tagged[1]
    monkeypatch.setattr(gemv_tune, "graph_time_us", lambda fn, reps, copies: {fast: 4.0, wrong: 3.0}.get(
        fn.__defaults__[0], 6.0) if fn.__defaults__ else 10.0)
    real = gemv_tune.candidate
    monkeypatch.setattr(gemv_tune, "candidate", lambda kind, w, x, config, **kw: real(kind, w, x, config, **kw) * (
        2 if config == wrong else 1))
    gemv_dispatch.clear()
    try:
        ws = [torch.randn(9, 256)]
        results = gemv_tune.tune_shape(kind, ws, 1)
        assert results["cublas"] == 10.0 and results["/".join(map(str, fast))] == 4.0
        assert results["/".join(map(str, wrong))].startswith("error: ValueError: M=1")
        assert all(isinstance(results["/".join(map(str, c))], float) for c in configs_for(1, kind, 9))
        monkeypatch.setenv("FXREWRITE_GEMV", "auto")
        assert gemv_dispatch.choose(kind, 9, 256, 1) == fast
        assert gemv_dispatch.choices() == {f"{kind} 9x256@1": "pipelined/16/256/3/4"}
        args = gemv_tune.make_inputs(kind, 1, 256, "cpu", torch.float32)
        with listen_launches(_Launches()) as seen:
            got = real(kind, ws[0], config=gemv_dispatch.choose(kind, 9, 256, 1), **args)
        assert _KERNEL in seen.names
        _close(got, gemv_tune.reference(kind, ws[0], **args), torch.float32)
    finally:
        gemv_dispatch.clear()


def test_compiles_for_sm90_with_the_weight_loads_pipelined():
    """Through triton's real compiler for an H100/H200 (no GPU here; a fresh process, as this one may interpret):
    every pipelined config's weight tiles are 16-byte cp.async copies with more than one commit group in flight and
    no register loads, where the skinny GEMV has plain 16-byte register loads and no cp.async. Built with PDL, the
    pipelined GEMV sends its first weight lines towards L2 before it waits on the previous kernel; with a prologue in
    its loop (norm with residual, silu) the weight tiles stay cp.async copies; the residual epilogue compiles too
    (its addend the one register load of the pipelined kernel)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.kernels.sm90_compile", "skinny-gemv-pipelined"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    loads = json.loads(done.stdout.splitlines()[-1])
    pipelined = {name: v for name, v in loads.items() if name.startswith("pipelined")}
    assert len(pipelined) == 2 * len(PIPELINED_CONFIGS), loads
    for name, v in pipelined.items():
        assert v["cp_async_16B"] > 0 and v["max_groups_in_flight"] > 0 and v["ld_global"] == 0, (name, v)
        assert v["prefetch_before_wait"] > 0, (name, v)
    fused = {name: v for name, v in loads.items() if name.startswith("fused-")}
    assert sorted(name.split()[0] for name in fused) == ["fused-norm", "fused-silu"], loads
    for name, v in fused.items():  # the prologue in the loop leaves the weight tiles cp.async copies
        assert v["cp_async_16B"] == pipelined[name.replace(name.split()[0], "pipelined")]["cp_async_16B"], (name, v)
        assert v["ld_global"] == 0 and v["prefetch_before_wait"] > 0, (name, v)
    epilogue = next(v for name, v in loads.items() if name.startswith("epilogue-add"))  # the residual epilogue
    assert epilogue["cp_async_16B"] == next(iter(pipelined.values()))["cp_async_16B"] and epilogue["ld_global"] > 0
    skinny = next(v for name, v in loads.items() if name.startswith("skinny"))
    assert skinny["cp_async"] == 0 and skinny["ld_global_v4"] > 0, skinny


def test_candidates_env_keeps_the_skinny_configs_only(monkeypatch):
    """FXREWRITE_GEMV_CANDIDATES=skinny: the candidates before the tagged backends; =separate-prologue: before the
    fused pipelined ones (same-machine baselines)."""
    monkeypatch.setenv("FXREWRITE_GEMV_CANDIDATES", "skinny")
    assert gemv_tune.candidates(1, "norm", 6144) == configs_for(1, "norm", 6144)
    monkeypatch.setenv("FXREWRITE_GEMV_CANDIDATES", "separate-prologue")
    assert gemv_tune.candidates(1, "silu", 2560) == (configs_for(1, "silu", 2560) + gemv_dispatch.pipelined_configs()
                                                     + gemv_dispatch.unfused_configs("silu", 2560))
    monkeypatch.setenv("FXREWRITE_GEMV_CANDIDATES", "some")
    with pytest.raises(ValueError,
                       match="FXREWRITE_GEMV_CANDIDATES='some': expected 'all', 'separate-prologue' or 'skinny'"):
        gemv_tune.candidates(1, "norm", 6144)
