"""RMSNorm / SiLU-and-mul with the FP8 activation quantization fused in, against the unfused torch references
in the Triton interpreter (float32, small sizes); the FP8 layers' norm_forward / silu_forward through them
against the unfused path. GPU: tests/gpu/test_gpu_fp8_quant.py."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels import fp8_dispatch, fp8_quant_fused
from fxrewrite.kernels.fp8_quant_fused import (
    rms_norm_quant_fp8,
    rms_norm_quant_fp8_ref,
    silu_and_mul_quant_fp8,
    silu_and_mul_quant_fp8_ref,
)
from fxrewrite.layers.activation import SiluAndMul
from fxrewrite.layers.fp8_linear import quantize_fp8_layer
from fxrewrite.layers.layernorm import RMSNorm
from fxrewrite.layers.linear import QKVParallelLinear, RowParallelLinear


def assert_same_fp8(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal FP8 values, except where the interpreter's float32 -> e4m3 cast fails to carry a round-up into
    the next power of two (31.1 -> 16 instead of 32) or truncates a subnormal (one step of 2**-9 less; the
    GPU rounds to nearest even)."""
    g, w = got.float(), want.float()
    bad = g != w
    carry = (g * 2 == w) & (w.abs().log2() == w.abs().log2().round())
    subnormal = (w.abs() < 2.0**-6) & ((g - w).abs() <= 2.0**-9)
    assert not (bad & ~carry & ~subnormal).any(), (g[bad & ~carry & ~subnormal][:8], w[bad & ~carry & ~subnormal][:8])
    assert bad.float().mean() < 0.06


def _check(got, want) -> None:
    assert_same_fp8(got[0], want[0])
    torch.testing.assert_close(got[1], want[1].expand_as(got[1]) if want[1].shape[1] == 1 else want[1],
                               rtol=1e-6, atol=0)


@pytest.fixture(params=["one pass", "chunks"])
def row_max(request, monkeypatch):
    """Both kernels: rows read once (the default up to ROW_MAX columns) and the chunk loop for longer ones."""
    if request.param == "chunks":
        monkeypatch.setattr(fp8_quant_fused, "ROW_MAX", 0)


@pytest.mark.parametrize("group_size", [None, 128])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("k", [320, 1536])  # a partial last group; two loop steps of 1024 columns
def test_rms_norm_quant_matches_unfused(interpret, row_max, group_size, with_residual, k):
    g = torch.Generator().manual_seed(k)
    x, r, w = torch.randn(3, k, generator=g), torch.randn(3, k, generator=g), torch.rand(k, generator=g).add(0.5)
    res = r if with_residual else None
    got = rms_norm_quant_fp8(x, w, 1e-6, res, group_size)
    want = rms_norm_quant_fp8_ref(x, w, 1e-6, res, group_size)
    _check(got, want)
    assert got[1].stride(0) == 1  # outer-dim major: what the FP8 GEMMs read
    assert (got[2] is None) == (not with_residual) and (got[2] is None or torch.equal(got[2], x + r))


def test_rms_norm_quant_reads_a_strided_weight(interpret):
    """A weight viewed with stride 2 (it was read as if contiguous: 90% of the codes wrong)."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 320, generator=g), torch.rand(320, 2, generator=g).add(0.5)
    _check(rms_norm_quant_fp8(x, w[:, 0], 1e-6), rms_norm_quant_fp8_ref(x, w[:, 0].contiguous(), 1e-6))


@pytest.mark.parametrize("group_size", [None, 128])
@pytest.mark.parametrize("k", [320, 1536])
def test_silu_and_mul_quant_matches_unfused(interpret, row_max, group_size, k):
    x = torch.randn(4, 2 * k, generator=torch.Generator().manual_seed(k))
    _check(silu_and_mul_quant_fp8(x, group_size), silu_and_mul_quant_fp8_ref(x, group_size))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="groups of 64 columns"):
        silu_and_mul_quant_fp8(torch.zeros(1, 256), 64)
    with pytest.raises(ValueError, match="even last dim"):
        silu_and_mul_quant_fp8(torch.zeros(1, 255))
    with pytest.raises(ValueError, match="do not fit"):
        rms_norm_quant_fp8(torch.zeros(2, 64), torch.ones(32), 1e-6)


@pytest.mark.parametrize("backend", [fp8_dispatch.ROWWISE, "triton_rowwise:0", "triton"])
def test_fp8_layers_quantize_inside_the_producer(interpret, monkeypatch, backend):
    torch.manual_seed(0)
    qkv = quantize_fp8_layer(QKVParallelLinear(256, 64, 2, 1), "qkv", (128, 128), per_channel=True)
    down = quantize_fp8_layer(RowParallelLinear(256, 256), "down", (128, 128), per_channel=True)
    norm = RMSNorm(256, 1e-6)
    x, res, gate_up = torch.randn(16, 256), torch.randn(16, 256), torch.randn(16, 512)
    ran = {}
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    monkeypatch.setattr(fp8_dispatch, "choose", lambda n, k, m, per_channel=False: backend)
    monkeypatch.setattr(fp8_dispatch, "run_quantized", lambda *a, real=fp8_dispatch.run_quantized, **kw: ran.setdefault(
        len(ran), real(*a, **kw)))
    monkeypatch.setattr(fp8_dispatch, "_run", lambda *a: (_ for _ in ()).throw(AssertionError("unfused path ran")))
    with torch.no_grad():
        out, new_res = qkv.norm_forward(x, norm, res)
        down_out = down.silu_forward(gate_up, SiluAndMul())
    assert len(ran) == 2
    h, want_res = norm(x, res)
    assert torch.equal(new_res, want_res)
    deq = {layer: layer.weight.float() * layer.weight_scale_inv[:, :1] for layer in (qkv, down)}
    for got, inp, layer in ((out, h, qkv), (down_out, SiluAndMul()(gate_up), down)):
        want = inp @ deq[layer].t()
        assert ((got - want).abs().max() / want.abs().max()) < 0.1  # FP8 activations: ~3 % typical


def test_a_failing_fused_kernel_falls_back_to_the_separate_ones(interpret, monkeypatch):
    from fxrewrite.layers import fp8_linear

    torch.manual_seed(0)
    qkv = quantize_fp8_layer(QKVParallelLinear(256, 64, 2, 1), "qkv", (128, 128), per_channel=True)
    norm = RMSNorm(256, 1e-6)
    x, res = torch.randn(16, 256), torch.randn(16, 256)
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    monkeypatch.setattr(fp8_dispatch, "choose", lambda n, k, m, per_channel=False: fp8_dispatch.ROWWISE)
    monkeypatch.setattr(fp8_linear, "rms_norm_quant_fp8", lambda *a: 1 / 0)
    monkeypatch.setattr(fp8_linear, "_fused_quant_failed", [])
    with torch.no_grad():
        out, new_res = qkv.norm_forward(x, norm, res)
        assert fp8_linear._fused_quant_failed == ["ZeroDivisionError: division by zero"]
        assert qkv._input_quantization(x) is None  # from now on the separate kernels
        torch.testing.assert_close(out, qkv(norm(x, res)[0]))
    assert torch.equal(new_res, x + res)
