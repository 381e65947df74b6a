"""The one-token FP8 gate_up GEMV with SiLU-and-mul in its epilogue: the kernel in the Triton interpreter against
`fp8_gemv_gated_ref` (shared block scales and per-channel, a partial last tile), its refusals, and the native MLP
through it (`fxrewrite.layers.fp8_gated`) against the unfused gate_up -> SiLU-and-mul -> down path, taken only
where the layer would have run the pipelined GEMV. GPU: tests/gpu/test_gpu_fp8_gemv_gated.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fxrewrite.kernels import fp8_dispatch, gemv_dispatch
from fxrewrite.kernels import fp8_gemv_gated as gated_kernel
from fxrewrite.kernels.fp8_gemv_gated import fp8_gemv_gated_ref, fp8_gemv_gated_triton
from fxrewrite.kernels.fp8_gemv_pipelined import PIPELINED_CONFIGS
from fxrewrite.kernels.gemv_tune import max_rel_error, scratch_scales
from fxrewrite.layers.fp8_gated import gated_config
from fxrewrite.layers.fp8_linear import quantize_fp8_layer
from fxrewrite.layers.layernorm import RMSNorm
from fxrewrite.runtime.models.llama import LlamaMLP

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("inter, k, per_channel, rows, config, dtype", [
    (48, 384, False, 16, (16, 128, 2, 4), torch.bfloat16),  # 3 tiles of 8 + 8 rows
    (40, 256, True, 1, (8, 256, 2, 4), torch.float32),  # per-channel, a partial last tile
    (64, 512, False, 32, (32, 256, 2, 4), torch.float32),
], ids=["shared-bf16", "channel-f32", "shared-f32"])
def test_gated_gemv_matches_the_reference(interpret, monkeypatch, inter, k, per_channel, rows, config, dtype):
    torch.manual_seed(0)
    w = torch.randn(2 * inter, k).mul(32).to(FP8)
    s = scratch_scales(2 * inter, k, "cpu", per_channel, rows)
    x = torch.randn(1, k).to(dtype)
    got = fp8_gemv_gated_triton(x, w, s, config, per_channel, rows)
    assert got.shape == (1, inter) and got.dtype == dtype
    # bf16: gate / up and the output are each rounded (a one-ulp flip of g moves silu(g) * u by ~2^-8)
    assert max_rel_error(got, fp8_gemv_gated_ref(x, w, s)) < (2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_gated_gemv_refuses_what_it_cannot_run():
    w, x = torch.zeros(96, 256, dtype=FP8), torch.zeros(1, 256)
    s = scratch_scales(96, 256, "cpu", rows=16)
    assert gated_kernel.supports((16, 256, 2, 4), 48, False, 16) and not gated_kernel.supports((64, 256, 2, 4), 48,
                                                                                              False, 16)
    assert not gated_kernel.supports((16, 256, 2, 4), 44, False, 8)  # the up rows would start mid-run
    with pytest.raises(ValueError, match="shared by runs of 32 rows"):
        fp8_gemv_gated_triton(x, w, s, (64, 256, 2, 4), False, 16)
    with pytest.raises(ValueError, match=r"x \(2, 256\)"):
        fp8_gemv_gated_triton(torch.zeros(2, 256), w, s, (16, 256, 2, 4), False, 16)


def _fp8_mlp(per_channel: bool):
    torch.manual_seed(0)
    cfg = SimpleNamespace(hidden_size=256, intermediate_size=384, hidden_act="silu")
    mlp = LlamaMLP(cfg, "cpu")
    quantize_fp8_layer(mlp.gate_up_proj, "gate_up_proj", (128, 128), per_channel)
    quantize_fp8_layer(mlp.down_proj, "down_proj", (128, 128), per_channel)
    norm = RMSNorm(256, 1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    return mlp, norm


@pytest.mark.parametrize("per_channel", [False, True], ids=["block", "channel"])
def test_native_mlp_takes_the_gated_gemv_where_the_pipelined_gemv_ran(interpret, monkeypatch, per_channel):
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    mlp, norm = _fp8_mlp(per_channel)
    gate_up = mlp.gate_up_proj
    n, k = gate_up.weight.shape
    fp8_dispatch.clear()
    gemv_dispatch.clear()
    fp8_dispatch.record(n, k, 1, [f"{fp8_dispatch.PIPELINED}:2"], per_channel=per_channel)  # (16, 256, 5, 4)
    calls = []
    real = gated_kernel.fp8_gemv_gated_triton
    monkeypatch.setattr("fxrewrite.layers.fp8_gated.fp8_gemv_gated_triton",
                        lambda *a, **kw: calls.append(a[3]) or real(*a, **kw))
    x, res = torch.randn(1, 256), torch.randn(1, 256)
    try:
        with torch.no_grad():
            got, got_res = mlp(x, norm, res)
            got_plain = mlp(x)
            assert calls == [PIPELINED_CONFIGS[2]] * 2
            monkeypatch.setenv("FXREWRITE_FP8_GATED", "0")
            want, want_res = mlp(x, norm, res)
            want_plain = mlp(x)
            assert len(calls) == 2
            monkeypatch.setenv("FXREWRITE_FP8_GATED", "1")
            two = mlp(torch.randn(2, 256))  # two tokens: the usual path
            gemv_dispatch.record("norm", n, k, 1, (4, 4, 2), "fp8-channel" if per_channel else "fp8")
            assert gated_config(gate_up, x, mlp.act_fn) is None  # the skinny GEMV was chosen: it stays
        assert len(calls) == 2 and two.shape == (2, 256)
    finally:
        fp8_dispatch.clear()
        gemv_dispatch.clear()
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)
    assert max_rel_error(got, want) < 1e-5 and max_rel_error(got_plain, want_plain) < 1e-5


def test_gated_switch_is_validated(monkeypatch):
    from fxrewrite.layers.fp8_gated import gated_enabled

    monkeypatch.setenv("FXREWRITE_FP8_GATED", "yes")
    with pytest.raises(ValueError, match="FXREWRITE_FP8_GATED='yes'"):
        gated_enabled()
