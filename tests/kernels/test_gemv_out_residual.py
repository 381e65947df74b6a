"""The skinny GEMVs' residual epilogue (``out_residual``: a decoder layer's closing ``r + down(h)``) in the Triton
interpreter: in every kernel form (skinny with and without split-K, pipelined, pipelined with the prologue fused
or before it, the dispatch's tags, the FP8 GEMV's torch add) the result is the same kernel's output without the
epilogue plus out_residual, rounded as torch rounds the two ops (float32: bitwise; bf16: the interpreter rounds
toward zero, so one bf16 step); the layer methods `add_forward` / `silu_forward(out_residual=...)` equal their
unfused forms; shapes and dtypes that do not fit are refused or take torch's add."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels import gemv_dispatch
from fxrewrite.kernels.skinny_gemv import SPLIT_CONFIGS, skinny_gemv_ref, skinny_gemv_triton
from fxrewrite.kernels.skinny_gemv_pipelined import (PIPELINED_CONFIGS, skinny_gemv_pipelined,
                                                     skinny_gemv_pipelined_fused, skinny_gemv_pipelined_triton)
from fxrewrite.layers.activation import SiluAndMul
from fxrewrite.layers.linear import ReplicatedLinear, RowParallelLinear


def _operands(m: int, n: int, k: int, dtype, silu: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * k if silu else k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).div(k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    r = torch.randn(m, n, generator=g).mul(4).to(dtype)
    return x, w, b, r


def _added(got, plain, r, dtype) -> None:
    """got == r + plain, as torch adds them (float32 bitwise; bf16 within one step of the interpreter's rounding)."""
    want = r + plain
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m, config", [(1, None), (3, None), (8, None), (1, SPLIT_CONFIGS[1][0]),
                                       (2, SPLIT_CONFIGS[2][0])], ids=str)
@pytest.mark.parametrize("silu", [False, True], ids=["linear", "silu"])
def test_skinny_epilogue(interpret, dtype, m, config, silu):
    x, w, b, r = _operands(m, 20, 320, dtype, silu, seed=m)
    kw = dict(silu_mul=silu, config=config)
    got = skinny_gemv_triton(x, w, b, out_residual=r, **kw)
    _added(got, skinny_gemv_triton(x, w, b, **kw), r, dtype)
    ref = skinny_gemv_ref(x, w, b, silu_mul=silu, out_residual=r)  # the torch ops: r + linear(...)
    scale = ref.float().abs().max()
    torch.testing.assert_close(got.float() / scale, ref.float() / scale, rtol=0, atol=2e-2 if dtype != torch.float32
                               else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pipelined_epilogue(interpret, dtype):
    x, w, b, r = _operands(1, 20, 600, dtype, seed=3)  # K past the last tile, partial row tiles
    for config in (PIPELINED_CONFIGS[0], PIPELINED_CONFIGS[4]):
        got = skinny_gemv_pipelined_triton(x, w, b, config, out_residual=r)
        _added(got, skinny_gemv_pipelined_triton(x, w, b, config), r, dtype)


@pytest.mark.parametrize("fused", [False, True], ids=["prologue-kernel", "prologue-fused"])
def test_pipelined_with_a_prologue(interpret, fused):
    x, w, b, r = _operands(1, 12, 256, torch.float32, silu=True, seed=4)
    run = skinny_gemv_pipelined_fused if fused else skinny_gemv_pipelined
    _added(run(x, w, b, silu_mul=True, out_residual=r), run(x, w, b, silu_mul=True), r, torch.float32)
    g = torch.Generator().manual_seed(5)
    h, res, nw = torch.randn(1, 256, generator=g), torch.randn(1, 256, generator=g), torch.rand(256, generator=g)
    got, new_res = run(h, w, b, norm_weight=nw, residual=res, out_residual=r)
    plain, plain_res = run(h, w, b, norm_weight=nw, residual=res)
    _added(got, plain, r, torch.float32)
    assert torch.equal(new_res, plain_res)


def test_dispatch_forms(interpret):
    x, w, b, r = _operands(1, 16, 256, torch.float32, silu=True, seed=6)
    plain = gemv_dispatch.run(x, w, b, (gemv_dispatch.UNFUSED, 8, 256, 2), silu_mul=True)
    got = gemv_dispatch.run(x, w, b, (gemv_dispatch.UNFUSED, 8, 256, 2), silu_mul=True, out_residual=r)
    _added(got, plain, r, torch.float32)
    fp8 = w.to(torch.float8_e4m3fn)
    scale = torch.ones(16, 2)
    x1 = x[:, :256].contiguous()
    plain = gemv_dispatch.run(x1, fp8, None, (4, 1, 2), w_scale=scale)
    _added(gemv_dispatch.run(x1, fp8, None, (4, 1, 2), w_scale=scale, out_residual=r), plain, r, torch.float32)


def test_refuses_what_does_not_fit(interpret):
    x, w, b, r = _operands(2, 20, 256, torch.float32)
    for bad in (r[:, :19], r.double(), r[:1]):
        with pytest.raises(ValueError, match="out_residual"):
            skinny_gemv_triton(x, w, b, out_residual=bad)
    with pytest.raises(ValueError, match="out_residual"):
        skinny_gemv_pipelined_triton(x[:1], w, b, PIPELINED_CONFIGS[0], out_residual=r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_methods(interpret, monkeypatch, dtype):
    torch.manual_seed(0)
    down = RowParallelLinear(48, 16, bias=True, params_dtype=dtype)
    plain = ReplicatedLinear(48, 16, bias=False, params_dtype=dtype)
    gate_up, h, r = torch.randn(3, 96).to(dtype), torch.randn(3, 48).to(dtype), torch.randn(3, 16).to(dtype)
    with torch.no_grad():
        want = [r + down.silu_forward(gate_up, SiluAndMul()), r + down(h), r + plain(h)]
        assert torch.equal(down.silu_forward(gate_up, SiluAndMul(), out_residual=r), want[0])  # off the GEMV
        monkeypatch.setenv("FXREWRITE_TRITON", "1")
        monkeypatch.setenv("FXREWRITE_GEMV", "on")
        for kind in ("silu", "linear"):
            gemv_dispatch.record(kind, 16, 48, 4, (8, 256, 4))
        gemv_plain = [down.silu_forward(gate_up, SiluAndMul()), down(h), plain(h)]
        got = [down.silu_forward(gate_up, SiluAndMul(), out_residual=r), down.add_forward(h, r),
               plain.add_forward(h, r)]
        promoted = down.add_forward(h, r.double())  # another dtype: torch's promoting add
    gemv_dispatch.clear()
    for g, p in zip(got, gemv_plain):
        _added(g, p, r, dtype)
    for g, w in zip(got, want):
        scale = w.float().abs().max()
        torch.testing.assert_close(g.float() / scale, w.float() / scale, rtol=0,
                                   atol=2e-2 if dtype != torch.float32 else 1e-5)
    assert promoted.dtype == torch.float64
