"""Skinny GEMV on FP8 weights (block-scaled and per-channel): every prologue and config against the torch
reference (the dequantized float32 product) in the Triton interpreter; the dispatch keyed by weight format;
FP8 layers' forward / norm_forward / silu_forward through it against the same layers dequantized; the
tuner's FP8 proof. GPU: tests/gpu/test_gpu_fp8.py."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels import gemv_dispatch, gemv_tune
from fxrewrite.kernels.skinny_gemv import FP8_CONFIGS, configs_for
from fxrewrite.kernels.skinny_gemv_fp8 import dequantize, skinny_gemv_fp8_ref, skinny_gemv_fp8_triton
from fxrewrite.layers.activation import SiluAndMul
from fxrewrite.layers.fp8_linear import dequantize_fp8_layer, quantize_fp8_layer
from fxrewrite.layers.layernorm import RMSNorm
from fxrewrite.layers.linear import QKVParallelLinear, RowParallelLinear
from fxrewrite.layers.skinny import gemv_shapes

FP8 = torch.float8_e4m3fn


def _weights(n: int, k: int, per_channel: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // 128)
    w = torch.randn(n, k, generator=g).mul(32).to(FP8)
    s = torch.rand(n, 1 if per_channel else groups, generator=g).add(0.5).div(32 * k ** 0.5)
    return w, s.expand(n, groups).contiguous().t().contiguous().t()  # strides (1, N), as on the GPU


def _args(kind: str, m: int, k: int, dtype, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    args = {"x": torch.randn(m, 2 * k if kind == "silu" else k, generator=g).to(dtype)}
    if kind in ("norm", "norm_res"):
        args["norm_weight"], args["eps"] = torch.rand(k, generator=g).add(0.5).to(dtype), 1e-5
    if kind == "norm_res":
        args["residual"] = torch.randn(m, k, generator=g).to(dtype)
    if kind == "silu":
        args["silu_mul"] = True
    return args


def _close(got, want, dtype) -> None:
    if isinstance(want, tuple):
        torch.testing.assert_close(got[1].float(), want[1].float(), rtol=1e-2 if dtype == torch.bfloat16 else 0,
                                   atol=0)
        got, want = got[0], want[0]
    scale = want.float().abs().max()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=2e-2)
    torch.testing.assert_close(got.float() / scale, want.float() / scale, **tol)


def test_dequantize_and_reference_are_the_plain_product():
    w, s = _weights(8, 200, per_channel=False)
    deq = dequantize(w, s)
    assert torch.equal(deq[:, 130], w[:, 130].float() * s[:, 1]) and torch.equal(deq[:, 5], w[:, 5].float() * s[:, 0])
    x, bias = torch.randn(3, 200), torch.randn(8)
    torch.testing.assert_close(skinny_gemv_fp8_ref(x, w, s, bias), x @ deq.t() + bias)
    wc, sc = _weights(8, 200, per_channel=True)
    assert torch.equal(dequantize(wc, sc, per_channel=True), dequantize(wc, sc))


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["linear", "norm_res", "silu"])
@pytest.mark.parametrize("m, n, k", [(1, 20, 320), (3, 9, 256)])  # partial N tiles, K not a whole step
def test_kernel_matches_reference(interpret, per_channel, dtype, kind, m, n, k):
    w, s = _weights(n, k, per_channel)
    args = _args(kind, m, k, dtype)
    bias = torch.randn(n).to(dtype) if kind == "linear" else None
    got = skinny_gemv_fp8_triton(w=w, w_scale=s, bias=bias, per_channel=per_channel, config=(4, 2, 1), **args)
    _close(got, skinny_gemv_fp8_ref(w=w, w_scale=s, bias=bias, per_channel=per_channel, **args), dtype)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("kind", ["linear", "silu"])
@pytest.mark.parametrize("m", [1, 3])
def test_out_residual_epilogue(interpret, per_channel, kind, m):
    """The closing residual add in the FP8 GEMV's epilogue: the kernel's own output plus out_residual, rounded as
    torch's add (float32: bitwise), and the reference's ``out_residual + product``."""
    w, s = _weights(20, 320, per_channel, seed=m)
    args = _args(kind, m, 320, torch.float32, seed=m)
    r = torch.randn(m, 20, generator=torch.Generator().manual_seed(9)).mul(4)
    kw = dict(w=w, w_scale=s, per_channel=per_channel, **args)
    got = skinny_gemv_fp8_triton(out_residual=r, config=(4, 2, 1), **kw)
    assert torch.equal(got, r + skinny_gemv_fp8_triton(config=(4, 2, 1), **kw))
    _close(got, skinny_gemv_fp8_ref(out_residual=r, **kw), torch.float32)


@pytest.mark.parametrize("bucket, config", [(b, c) for b, cs in FP8_CONFIGS.items() for c in cs], ids=repr)
def test_every_config(interpret, bucket, config):
    w, s = _weights(3, 1024, per_channel=False, seed=bucket)
    args = _args("norm", bucket, 1024, torch.float32, seed=bucket)
    _close(skinny_gemv_fp8_triton(w=w, w_scale=s, config=config, **args), skinny_gemv_fp8_ref(w=w, w_scale=s, **args),
           torch.float32)


def test_bad_fp8_operands_are_refused():
    w, s = _weights(8, 256, per_channel=False)
    with pytest.raises(ValueError, match="float32 scales"):
        skinny_gemv_fp8_ref(torch.zeros(1, 256), w, s[:, :1])
    with pytest.raises(ValueError, match="float8_e4m3fn weight"):
        skinny_gemv_fp8_ref(torch.zeros(1, 256), w.float(), s)
    with pytest.raises(ValueError, match="weight format 'int4'"):
        configs_for(1, fmt="int4")


def test_dispatch_keeps_formats_apart(monkeypatch):
    gemv_dispatch.clear()
    monkeypatch.setenv("FXREWRITE_GEMV", "auto")
    gemv_dispatch.record("norm", 64, 256, 2, (4, 4, 2), "fp8")
    gemv_dispatch.record("norm", 64, 256, 2, None, "fp8-channel")
    assert gemv_dispatch.choose("norm", 64, 256, 2) is None  # bf16 weight of the same shape: untuned
    assert gemv_dispatch.choose("norm", 64, 256, 2, "fp8") == (4, 4, 2)
    assert gemv_dispatch.choices() == {"norm 64x256@2 fp8": "4/4/2", "norm 64x256@2 fp8-channel": "cublas"}
    w, s = _weights(64, 256, per_channel=False)
    assert gemv_dispatch.weight_format(w) is None and gemv_dispatch.weight_format(w, s) == "fp8"
    assert gemv_dispatch.weight_format(w, s, per_channel=True) == "fp8-channel"
    monkeypatch.setenv("FXREWRITE_GEMV", "on")
    assert gemv_dispatch.choose("linear", 64, 256, 1, "fp8") == FP8_CONFIGS[1][0]
    gemv_dispatch.clear()


def _fp8_layers(per_channel: bool):
    torch.manual_seed(0)
    qkv = quantize_fp8_layer(QKVParallelLinear(256, 64, 2, 1), "qkv", (128, 128), per_channel)
    down = quantize_fp8_layer(RowParallelLinear(384, 256), "down", (128, 128), per_channel)
    norm = RMSNorm(256, 1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    for kind, n, k in (("norm", 256, 256), ("silu", 256, 384), ("linear", 256, 384)):
        gemv_dispatch.record(kind, n, k, 4, (128, 2, 4), "fp8-channel" if per_channel else "fp8")  # 2 programs
    return qkv, down, norm


def _record_gemv_runs(monkeypatch) -> list[dict]:
    """Triton on (interpreted), the tuned GEMV choices honoured; each `gemv_dispatch.run` call's keywords noted."""
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    monkeypatch.setenv("FXREWRITE_GEMV", "auto")
    calls = []
    real_run = gemv_dispatch.run
    monkeypatch.setattr(gemv_dispatch, "run", lambda *a, **kw: calls.append(kw) or real_run(*a, **kw))
    return calls


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_layers_run_the_gemv_like_their_dequantized_twins(interpret, monkeypatch, per_channel):
    qkv, down, norm = _fp8_layers(per_channel)
    x, res, gate_up = torch.randn(3, 256), torch.randn(3, 256), torch.randn(3, 768)
    calls = _record_gemv_runs(monkeypatch)
    with torch.no_grad():
        got = [qkv.norm_forward(x, norm, res), down.silu_forward(gate_up, SiluAndMul()), down(gate_up[:, :384])]
        assert len(calls) == 3 and all(c["w_scale"] is not None for c in calls)
        for layer in (qkv, down):
            dequantize_fp8_layer(layer, torch.float32)
        want = [qkv.norm_forward(x, norm, res), down.silu_forward(gate_up, SiluAndMul()), down(gate_up[:, :384])]
    gemv_dispatch.clear()
    for g, w in zip(got, want):
        _close(g, w, torch.float32)


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_layers_fold_the_rewrite_norm_and_residual_into_the_gemv(interpret, monkeypatch, per_channel):
    """What a rewritten decoder layer asks of FP8 layers at decode: the closing residual add in down_proj's GEMV
    epilogue (`silu_forward(out_residual=...)`, `add_forward`), and qkv_proj applying an input norm left pending
    for it (`PENDING_NORM_ATTR`, fxrewrite.layers.input_norm) in its GEMV's prologue: one GEMV launch each, results
    as the unfused ops give them (float32: bitwise against the same kernels without the fold)."""
    from fxrewrite.layers.linear import PENDING_NORM_ATTR

    qkv, down, norm = _fp8_layers(per_channel)
    x, gate_up, r = torch.randn(3, 256), torch.randn(3, 768), torch.randn(3, 256)
    calls = _record_gemv_runs(monkeypatch)
    with torch.no_grad():
        got = [down.silu_forward(gate_up, SiluAndMul(), out_residual=r), down.add_forward(gate_up[:, :384], r)]
        qkv.__dict__[PENDING_NORM_ATTR] = norm
        got.append(qkv(x))
        assert PENDING_NORM_ATTR not in qkv.__dict__ and len(calls) == 3, calls
        assert [c.get("out_residual") is not None for c in calls] == [True, True, False]
        assert calls[2]["norm_weight"] is norm.weight
        want = [r + down.silu_forward(gate_up, SiluAndMul()), r + down(gate_up[:, :384]), qkv(norm(x))]
    gemv_dispatch.clear()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _close(got[2], want[2], torch.float32)  # the norm's factor applied after the dot: float32 rounding apart


def test_tuner_proves_fp8_configs_against_the_dequantized_product(interpret, monkeypatch):
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    configs = configs_for(1, fmt="fp8")
    monkeypatch.setattr(gemv_tune, "graph_time_us", lambda fn, reps, copies: 1.0 if fn.__defaults__ else 9.0)
    real = gemv_tune.candidate
    monkeypatch.setattr(gemv_tune, "candidate", lambda kind, w, x, config, **kw: real(kind, w, x, config, **kw) * (
        1 if config == configs[1] else 2))  # only configs[1] is right
    monkeypatch.setattr(gemv_tune, "configs_for", lambda m, kind, n, fmt: configs[:2])
    gemv_dispatch.clear()
    ws = gemv_tune.scratch_weights(4, 256, "cpu", FP8)
    results = gemv_tune.tune_shape("silu", ws, 1, torch.float32, "fp8")
    assert results["cublas"] == 9.0 and results["/".join(map(str, configs[0]))].startswith("error: ValueError: M=")
    monkeypatch.setenv("FXREWRITE_GEMV", "auto")
    assert gemv_dispatch.choose("silu", 4, 256, 1, "fp8") == configs[1]
    gemv_dispatch.clear()


def test_tuner_times_the_block_scaled_baseline_the_layer_runs(monkeypatch):
    """Block-scaled FP8 shapes carry the layers' scale rows: the scratch scales are equal in aligned runs of them
    and the baseline's FP8 product is told so (the pipelined GEMV's shared-scale form, what the layer runs);
    per-channel and float shapes carry 1."""
    qkv = quantize_fp8_layer(QKVParallelLinear(256, 16, 8, 8), "qkv", (128, 128))  # q / k / v 128 rows each
    odd = quantize_fp8_layer(QKVParallelLinear(256, 16, 3, 1), "odd", (128, 128))  # q 48 / k 16 / v 16: gcd 16
    channel = quantize_fp8_layer(RowParallelLinear(384, 256), "down", (128, 128), per_channel=True)
    shapes = gemv_shapes(torch.nn.ModuleList([qkv, odd, channel]))
    assert shapes == {("linear", 384, 256, "fp8", 128), ("linear", 80, 256, "fp8", 16),
                      ("linear", 256, 384, "fp8-channel", 1)}
    same_shape = quantize_fp8_layer(QKVParallelLinear(256, 32, 8, 2), "same", (128, 128))  # 256 / 64 / 64: gcd 64
    # two layers of one shape, one tuning: the fewer shared rows (what both can run)
    assert gemv_shapes(torch.nn.ModuleList([qkv, same_shape])) == {("linear", 384, 256, "fp8", 64)}

    s = gemv_tune.scratch_scales(300, 256, "cpu", rows=128)
    assert s.shape == (300, 2) and s.stride() == (1, 300)
    for lo, hi in ((0, 128), (128, 256), (256, 300)):
        assert torch.equal(s[lo:hi], s[lo:lo + 1].expand(hi - lo, 2)) and not torch.equal(s[lo], s[(lo + 128) % 300])

    seen = []
    monkeypatch.setattr(gemv_tune, "fp8_linear_dispatch", lambda *a, **kw: seen.append(kw["scale_rows"]) or a[0])
    monkeypatch.setattr(gemv_tune, "graph_time_us", lambda fn, reps, copies: fn(0) is None or 1.0)
    monkeypatch.setattr(gemv_tune, "candidates", lambda *a, **kw: ())
    ws = gemv_tune.scratch_weights(256, 256, "cpu", FP8)
    gemv_tune.tune_shape("linear", ws, 1, torch.float32, "fp8", 128)
    gemv_tune.tune_shape("linear", ws, 1, torch.float32, "fp8-channel")
    assert seen == [128, 1]
    gemv_dispatch.clear()
