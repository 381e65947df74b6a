"""Skinny GEMV: every config and prologue (none, bias, RMSNorm, RMSNorm + residual, SiLU-and-mul) against the
unfused torch reference in the Triton interpreter, float32 and bf16; the dispatch's modes and eligibility;
the fused layer methods against their unfused forms (GPU: tests/gpu/test_gpu_skinny_gemv.py)."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels.batch_invariant import batch_invariant_mode

from fxrewrite.kernels import gemv_dispatch
from fxrewrite.kernels.skinny_gemv import CONFIGS, GEMV_MAX_M, configs_for, skinny_gemv_ref, skinny_gemv_triton
from fxrewrite.layers.activation import SiluAndMul
from fxrewrite.layers.layernorm import RMSNorm
from fxrewrite.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear

_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.bfloat16: dict(rtol=0, atol=2e-2)}


def _args(kind: str, m: int, n: int, k: int, dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    args = {"x": torch.randn(m, 2 * k if kind == "silu" else k, generator=g).to(dtype),
            "w": torch.randn(n, k, generator=g).div(k ** 0.5).to(dtype)}
    if kind == "bias":
        args["bias"] = torch.randn(n, generator=g).to(dtype)
    if kind in ("norm", "norm_res"):
        args["norm_weight"], args["eps"] = torch.rand(k, generator=g).add(0.5).to(dtype), 1e-5
    if kind == "norm_res":
        args["residual"] = torch.randn(m, k, generator=g).to(dtype)
    if kind == "silu":
        args["silu_mul"] = True
    return args


def _compare(got, want, dtype) -> None:
    if isinstance(want, tuple):
        # the new residual: one rounding of x + residual (the interpreter rounds bf16 toward zero, the GPU to
        # nearest: one bf16 step apart at most)
        torch.testing.assert_close(got[1].float(), want[1].float(), rtol=1e-2 if dtype == torch.bfloat16 else 0,
                                   atol=0)
        got, want = got[0], want[0]
    scale = want.float().abs().max()
    torch.testing.assert_close(got.float() / scale, want.float() / scale, **_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["bias", "norm", "norm_res", "silu"])
@pytest.mark.parametrize("m, n, k", [(1, 20, 192), (3, 9, 256), (8, 5, 320)])  # partial N tiles, uneven K
def test_kernel_matches_unfused_ref(interpret, dtype, kind, m, n, k):
    args = _args(kind, m, n, k, dtype)
    _compare(skinny_gemv_triton(**args), skinny_gemv_ref(**args), dtype)


@pytest.mark.parametrize("bucket, config", [(b, c) for b, cs in CONFIGS.items() for c in cs], ids=repr)
def test_every_config(interpret, bucket, config):
    args = _args("norm_res", bucket, 5, 1024, torch.float32, seed=bucket)  # K = 1024: even K for every block_k
    _compare(skinny_gemv_triton(**args, config=config), skinny_gemv_ref(**args), torch.float32)


def test_ref_is_the_unfused_ops():
    args = _args("norm_res", 2, 8, 64, torch.float32)
    out, res = skinny_gemv_ref(**args)
    assert torch.equal(res, args["x"] + args["residual"])
    norm = RMSNorm(64, 1e-5)
    norm.weight.data.copy_(args["norm_weight"])
    torch.testing.assert_close(out, torch.nn.functional.linear(norm(res), args["w"]))


def test_bad_shapes_are_refused():
    w = torch.zeros(8, 64)
    with pytest.raises(ValueError, match="expected \\[M, 128\\]"):
        skinny_gemv_ref(torch.zeros(1, 64), w, silu_mul=True)
    with pytest.raises(ValueError, match="needs norm_weight"):
        skinny_gemv_ref(torch.zeros(1, 64), w, residual=torch.zeros(1, 64))
    with pytest.raises(ValueError, match=f"1..{GEMV_MAX_M} rows"):
        configs_for(GEMV_MAX_M + 1)


def test_dispatch_modes(monkeypatch):
    gemv_dispatch.clear()
    monkeypatch.setenv("FXREWRITE_GEMV", "auto")
    assert gemv_dispatch.choose("linear", 64, 32, 1) is None  # untuned: cuBLAS
    gemv_dispatch.record("linear", 64, 32, 4, (2, 512, 4))
    gemv_dispatch.record("norm", 64, 32, 4, None)
    assert gemv_dispatch.choose("linear", 64, 32, 3) == (2, 512, 4) and gemv_dispatch.choose("norm", 64, 32, 3) is None
    assert gemv_dispatch.choices() == {"linear 64x32@4": "2/512/4", "norm 64x32@4": "cublas"}
    monkeypatch.setenv("FXREWRITE_GEMV", "on")
    assert gemv_dispatch.choose("linear", 64, 32, 1) == configs_for(1)[0]  # untuned: the first candidate
    assert gemv_dispatch.choose("norm", 64, 32, 3) is None and gemv_dispatch.choose("linear", 64, 32, 9) is None
    monkeypatch.setenv("FXREWRITE_GEMV", "off")
    assert gemv_dispatch.choose("linear", 64, 32, 3) is None
    monkeypatch.setenv("FXREWRITE_GEMV", "yes")
    with pytest.raises(ValueError, match="FXREWRITE_GEMV='yes'"):
        gemv_dispatch.mode()
    gemv_dispatch.clear()


def test_eligibility(interpret, monkeypatch):
    monkeypatch.setenv("FXREWRITE_GEMV", "on")
    x, w = torch.randn(2, 32), torch.randn(16, 32)
    assert gemv_dispatch.config_for_call("linear", x, w) is None  # CPU without FXREWRITE_TRITON: reference
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    assert gemv_dispatch.config_for_call("linear", x, w) == configs_for(2)[0]
    assert gemv_dispatch.config_for_call("linear", x.bfloat16(), w) is None  # mixed dtypes
    assert gemv_dispatch.config_for_call("linear", torch.randn(9, 32), w) is None  # too many rows
    assert gemv_dispatch.config_for_call("linear", x, w.requires_grad_()) is None  # autograd records
    with torch.no_grad():
        assert gemv_dispatch.config_for_call("linear", x, w) is not None
        with batch_invariant_mode():  # batch-invariant engines keep one kernel for every token count
            assert gemv_dispatch.config_for_call("linear", x, w) is None


def _layers(dtype):
    torch.manual_seed(0)
    qkv = QKVParallelLinear(64, 8, 2, 1, bias=True, params_dtype=dtype)
    down = RowParallelLinear(48, 16, bias=True, params_dtype=dtype)
    norm = RMSNorm(64, 1e-6, dtype=dtype)
    for kind, n, k in (("norm", 32, 64), ("silu", 16, 48), ("linear", 16, 48)):
        gemv_dispatch.record(kind, n, k, 4, (8, 256, 4))  # few programs: the interpreter runs them one by one
    norm.weight.data.uniform_(0.5, 1.5)
    return qkv, down, norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_methods_fused_match_unfused(interpret, monkeypatch, dtype):
    qkv, down, norm = _layers(dtype)
    x, res, gate_up = torch.randn(3, 64).to(dtype), torch.randn(3, 64).to(dtype), torch.randn(3, 96).to(dtype)
    with torch.no_grad():
        want = [qkv.norm_forward(x, norm, res), qkv.norm_forward(x, norm), down.silu_forward(gate_up, SiluAndMul()),
                down(gate_up[:, :48])]
        monkeypatch.setenv("FXREWRITE_TRITON", "1")
        monkeypatch.setenv("FXREWRITE_GEMV", "on")
        got = [qkv.norm_forward(x, norm, res), qkv.norm_forward(x, norm), down.silu_forward(gate_up, SiluAndMul()),
               down(gate_up[:, :48])]
    gemv_dispatch.clear()
    for g, w in zip(got, want):
        _compare(g, w, dtype)
    assert got[1][1] is x  # no residual: the stream passes through


def test_layer_methods_off_the_gemv_are_the_plain_ops(monkeypatch):
    qkv, down, norm = _layers(torch.float32)
    gemv_dispatch.clear()
    x, res = torch.randn(2, 64), torch.randn(2, 64)
    out, new_res = qkv.norm_forward(x, norm, res)
    h, want_res = norm(x, res)
    assert torch.equal(out, qkv(h)) and torch.equal(new_res, want_res)
    gate_up = torch.randn(2, 96)
    assert torch.equal(down.silu_forward(gate_up, SiluAndMul()), down(SiluAndMul()(gate_up)))


def test_adopted_linear_keeps_parameters():
    from fxrewrite.layers.skinny import adopt_plain_linears, gemv_shapes

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2, bias=False))
    params = dict(model.named_parameters())
    x = torch.randn(3, 8)
    want = model(x)
    assert adopt_plain_linears(model) == 2 and isinstance(model[0], ReplicatedLinear)
    assert dict(model.named_parameters()) == params
    assert torch.equal(model(x), want)
    assert gemv_shapes(model) == {("linear", 4, 8, "float", 1), ("linear", 2, 4, "float", 1)}


def test_tuner_records_the_fastest_proven_config(interpret, monkeypatch):
    from fxrewrite.kernels import gemv_tune

    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    configs = configs_for(2)
    fake_us = {"unfused": 10.0, configs[0]: 12.0, configs[1]: 7.0, configs[2]: 5.0}
    monkeypatch.setattr(gemv_tune, "graph_time_us", lambda fn, reps, copies: fake_us[fn.__defaults__[0]]
                        if fn.__defaults__ else fake_us["unfused"])
    real = gemv_tune.candidate

    def wrong_for_the_fastest(kind, w, x, config, **kw):  # the fastest config computes garbage: never chosen
        out = real(kind, w, x, config, **kw)
        return out * 2 if config == configs[2] else out

    monkeypatch.setattr(gemv_tune, "candidate", wrong_for_the_fastest)
    gemv_dispatch.clear()
    ws = [torch.randn(4, 256)]
    results = gemv_tune.tune_shape("norm", ws, 2)
    assert results["cublas"] == 10.0 and results["/".join(map(str, configs[1]))] == 7.0
    assert results["/".join(map(str, configs[2]))].startswith("error: ValueError: M=")
    monkeypatch.setenv("FXREWRITE_GEMV", "auto")
    assert gemv_dispatch.choose("norm", 4, 256, 2) == configs[1]
    fake_us["unfused"] = 1.0  # cuBLAS faster than every config: the bucket records None
    gemv_tune.tune_shape("norm", ws, 2)
    assert gemv_dispatch.choose("norm", 4, 256, 2) is None
    gemv_dispatch.clear()
