"""Per-channel FP8 (quantization="fp8" on a float checkpoint): the per-token activation quantization
kernel (Triton interpreter) against its torch reference, the per-channel weight round trip against
float32, torch's row-wise scaled matmul (it has a CPU kernel) against the dequantized reference, and
the backend dispatch offering ``scaled_mm_rowwise`` only to per-channel layers."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels import fp8_dispatch, fp8_tune
from fxrewrite.kernels.fp8_gemm import FP8_DTYPE, FP8_MAX, GemmConfig, fp8_linear
from fxrewrite.kernels.fp8_rowwise import (
    ROWWISE_CONFIGS,
    channel_scales,
    fp8_rowwise_gemm_ref,
    fp8_rowwise_gemm_triton,
    fp8_scaled_mm_rowwise,
    per_token_quant_fp8,
    per_token_quant_fp8_ref,
)
from fxrewrite.layers.fp8_linear import quantize_fp8_layer, quantize_weight_fp8_per_channel
from fxrewrite.layers.linear import QKVParallelLinear

ROWWISE = fp8_dispatch.ROWWISE


@pytest.mark.parametrize("k", [1100, 16500])  # the row in registers; over 16384 columns, two passes in 1024 chunks
def test_per_token_quant_kernel_matches_reference(interpret, monkeypatch, k):
    """The Triton kernel (interpreted) against the reference. Values on the FP8 grid times a power of two per row,
    each row's amax 448 x that power: the scale is exact and quantizing rounds nothing, so codes must be equal
    (triton's interpreter rounds some float32 -> e4m3 carries differently from torch, hence no random codes here;
    on a GPU: tests/gpu/test_gpu_fp8.py); a zero row takes the 1e-10 floor."""
    from fxrewrite.kernels import use_triton

    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    grid = torch.randn(5, k, generator=torch.Generator().manual_seed(k)).clamp(-400, 400).to(FP8_DTYPE).float()
    grid[:, 7] = 448.0
    x = grid * torch.tensor([1.0, 2.0**3, 2.0**-10, 0.0, 2.0**8])[:, None]
    assert use_triton(x)  # else per_token_quant_fp8 would return the reference itself
    q, s = per_token_quant_fp8(x)
    q_ref, s_ref = per_token_quant_fp8_ref(x)
    assert s.shape == (5, 1) and s.dtype == torch.float32
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert torch.equal(q.float(), q_ref.float())
    torch.testing.assert_close(s_ref[:, 0], x.abs().amax(1).clamp_min(1e-10) / FP8_MAX)
    q3, s3 = per_token_quant_fp8(x.view(5, 1, k))  # [..., K] like the reference
    assert q3.shape == (5, 1, k) and s3.shape == (5, 1, 1) and torch.equal(q3.view(5, k).float(), q.float())


def test_per_token_quant_reference_is_within_fp8_precision():
    x = torch.randn(5, 1100) * torch.tensor([1.0, 10.0, 1e-3, 0.0, 300.0])[:, None]
    q_ref, s_ref = per_token_quant_fp8_ref(x)
    # e4m3: 3 mantissa bits (relative half step 1/16); e4m3's subnormal step is 2**-9 of a unit of scale
    assert ((q_ref.float() * s_ref - x).abs() <= 0.07 * x.abs() + s_ref * 2.0**-9).all()


def test_per_channel_round_trip_against_float32():
    w = torch.randn(48, 320) * torch.logspace(-3, 2, 48)[:, None]
    w[7] = 0.0
    q, scale = quantize_weight_fp8_per_channel(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (48,) and scale[7] == 1.0
    torch.testing.assert_close(scale[:7], w[:7].abs().amax(1) / FP8_MAX)
    deq = q.float() * scale[:, None]
    torch.testing.assert_close(deq.abs().amax(1)[:7], w[:7].abs().amax(1), rtol=1e-6, atol=0)  # amax -> 448
    err = (deq - w).abs() / w.abs().amax(1, keepdim=True).clamp_min(1e-30)
    assert err.max() < 2 ** -4 and err.mean() < 0.01


def test_rowwise_scaled_mm_matches_reference():
    a, a_s = per_token_quant_fp8_ref(torch.randn(7, 256))
    w, w_s = quantize_weight_fp8_per_channel(torch.randn(64, 256))
    want = fp8_rowwise_gemm_ref(a, a_s, w, w_s[None], torch.float32)
    got = fp8_scaled_mm_rowwise(a, a_s, w, w_s[None], torch.bfloat16)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("m, n, k, config", [(5, 72, 320, GemmConfig(16, 32, group_m=2)),
                                             (33, 40, 256, ROWWISE_CONFIGS[0]), (70, 136, 128, GemmConfig(32, 64))])
def test_triton_rowwise_gemm_matches_reference(interpret, m, n, k, config):
    """Ragged M / N tiles (wrapped rows never stored), K past the last 128 columns, group-M swizzle,
    and activation scales that are a strided column (a fused producer's [M, 1] view)."""
    a, a_s = per_token_quant_fp8_ref(torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None])
    w, w_s = quantize_weight_fp8_per_channel(torch.randn(n, k) * torch.logspace(1, -3, n)[:, None])
    a_s = torch.cat([a_s, torch.zeros_like(a_s)], 1)[:, :1]  # stride (2, 1)
    want = fp8_rowwise_gemm_ref(a, a_s, w, w_s[None], torch.float32)
    got = fp8_rowwise_gemm_triton(a, a_s, w, w_s[None].contiguous(), torch.float32, config)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert fp8_rowwise_gemm_triton(a[:0], a_s[:0], w, w_s[None].contiguous(), torch.float32, config).shape == (0, n)


def test_per_channel_layer_runs_every_backend_alike(interpret, monkeypatch):
    """A fused QKV layer quantized per channel: every group of a row holds the row's scale (so the group
    kernels run unchanged), scaled_mm_rowwise reads column 0, and all agree with the dequantized layer."""
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    layer = QKVParallelLinear(256, 64, 4, 1, bias=False, device="cpu")
    torch.nn.init.normal_(layer.weight)
    layer = quantize_fp8_layer(layer, "qkv", (128, 128), per_channel=True)
    s = layer.weight_scale_inv
    assert layer.weight_per_channel and s.shape == (384, 2) and torch.equal(s[:, 0], s[:, 1])
    assert torch.equal(channel_scales(s.t().contiguous().t()), s[:, 0][None])
    x = torch.randn(3, 256)
    want = x @ (layer.weight.float() * s[:, :1]).t()  # float32 activations x the dequantized weight
    torch.testing.assert_close(fp8_linear(x, layer.weight, s), fp8_dispatch.fp8_linear_dispatch(
        x, layer.weight, s, backend="triton", per_channel=True), rtol=1e-4, atol=1e-3)
    for backend in ("triton", "gemv:0", ROWWISE, "triton_rowwise:0"):  # activation rounding: ~3 % of the largest output
        got = fp8_dispatch.fp8_linear_dispatch(x, layer.weight, s, backend=backend, per_channel=True)
        assert (got - want).abs().max() / want.abs().max() < fp8_tune.TOLERANCE, backend
    for backend in (ROWWISE, "triton_rowwise:1"):
        with pytest.raises(ValueError, match="needs per-channel weight scales"):
            fp8_dispatch.fp8_linear_dispatch(x, layer.weight, s, backend=backend)


def test_rowwise_is_offered_and_chosen_only_for_per_channel_weights():
    assert ROWWISE in fp8_tune.candidates(2560, 9728, 256, per_channel=True)
    assert ROWWISE not in fp8_tune.candidates(2560, 9728, 256)
    assert ROWWISE not in fp8_tune.candidates(2560, 9720, 256, per_channel=True)  # K not a multiple of 16
    triton_rowwise = [f"triton_rowwise:{i}" for i in range(len(ROWWISE_CONFIGS))]
    assert set(triton_rowwise) <= set(fp8_tune.candidates(2560, 9720, 256, per_channel=True))
    assert not set(triton_rowwise) & set(fp8_tune.candidates(2560, 9728, 256) + fp8_tune.candidates(
        2560, 9728, 16, per_channel=True) + fp8_tune.candidates(2560, 9728, 1024, per_channel=True))
    # not for block-scaled weights, decode counts (the GEMVs' range) or large M (CUTLASS's)
    fp8_dispatch.clear()
    for ranked in ([ROWWISE, "triton"], ["triton", "triton_rowwise:2"]):
        with pytest.raises(ValueError, match="need per-channel weight scales"):
            fp8_dispatch.record(2560, 9728, 256, ranked)
    fp8_dispatch.record(2560, 9728, 256, [ROWWISE, "triton"], per_channel=True)
    fp8_dispatch.record(2560, 9728, 256, ["scaled_mm"])
    assert fp8_dispatch.choose(2560, 9728, 200, per_channel=True) == ROWWISE
    assert fp8_dispatch.choose(2560, 9728, 200) == "scaled_mm"
    assert fp8_dispatch.choices() == {"2560x9728@256": "scaled_mm", "2560x9728@256/channel": ROWWISE}
    fp8_dispatch.clear()


def test_tuner_proves_rowwise_on_per_channel_scratch(interpret, monkeypatch):
    """The tuner (CPU: interpreter, capture and timing faked) times and proves scaled_mm_rowwise for a
    per-channel shape and records it under the per-channel key only."""
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    monkeypatch.setattr(fp8_tune.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(fp8_tune, "capture", lambda fn: (type("G", (), {"replay": lambda self: None})(), fn()))
    monkeypatch.setattr(fp8_tune, "graph_time_us",
                        lambda fn, reps, copies: (fn(0), 1.0 if fn.__defaults__[0] == ROWWISE else 2.0)[1])
    fp8_dispatch.clear()
    torch.manual_seed(0)
    ws, w_s, wf = fp8_tune._scratch(32, 256, "cpu", per_channel=True)
    assert torch.equal(w_s[:, 0], w_s[:, 1]) and w_s.stride() == (1, 32)
    results = fp8_tune._tune_bucket(ws, w_s, wf, 4, torch.bfloat16, per_channel=True)
    assert results[ROWWISE] == 1.0, results
    assert fp8_dispatch.choose(32, 256, 3, per_channel=True) == ROWWISE
    assert fp8_dispatch.choose(32, 256, 3) == "gemv:0"  # block-scaled layers of the shape: untouched
    fp8_dispatch.clear()
