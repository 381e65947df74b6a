"""FP8 GEMM backends: every Triton tile config (old table, new table, tuner alternatives) against the
reference with outer-dim-major scales (Triton interpreter); the scale layouts built for torch's
block-scaled matmul pass torch's own shape/stride checks (its meta kernels mirror ScaledBlas.cpp);
the per-M backend choice, its override and its demotion after a failure (the GPU runs, tuner and
CUDA-graph capture included, are in tests/gpu/test_gpu_fp8.py)."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels import fp8_dispatch, fp8_tune
from fxrewrite.kernels import fp8_gemm as mod
from fxrewrite.kernels.fp8_gemm import fp8_block_gemm_ref, fp8_linear, per_token_group_quant_fp8_ref
from fxrewrite.kernels.fp8_gemv import fp8_block_gemv_triton, fp8_weight_only_gemv_ref
from fxrewrite.kernels.fp8_scaled_mm import (
    activation_scales_outer_major,
    fp8_scaled_mm,
    row_scales_for_scaled_mm,
    weight_block_scales_for_scaled_mm,
)

_ALL_CONFIGS = sorted({cfg for _, cfg in mod.OLD_CONFIGS + mod.CONFIGS} | set(mod.ALT_CONFIGS), key=repr)


@pytest.mark.parametrize("config", _ALL_CONFIGS, ids=repr)
def test_every_triton_config_matches_ref_with_outer_major_scales(interpret, config):
    m, n, k = 70, 136, 256  # partial M and N tiles; group-M swizzle over 2 row tiles of 64
    aq, a_s = per_token_group_quant_fp8_ref(torch.randn(m, k))
    wq, w_s = per_token_group_quant_fp8_ref(torch.randn(n, k))
    want = fp8_block_gemm_ref(aq, a_s, wq, w_s, out_dtype=torch.float32)
    got = mod.fp8_block_gemm_triton(aq, activation_scales_outer_major(a_s), wq, row_scales_for_scaled_mm(w_s),
                                    out_dtype=torch.float32, config=config)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m, n, k", [(1, 100, 256), (3, 64, 200), (4, 40, 640)])  # partial N tile / last group
@pytest.mark.parametrize("block_n, target, step", [(16, 1024, 4), (32, 2, 2)])  # split K over all steps / over 2
def test_gemv_kernel_matches_ref(interpret, m, n, k, block_n, target, step):
    x = torch.randn(m, k)
    aq, a_s = per_token_group_quant_fp8_ref(x)
    wq, w_s = per_token_group_quant_fp8_ref(torch.randn(n, k))
    want = fp8_block_gemm_ref(aq, a_s, wq, w_s, out_dtype=torch.float32)  # W8A8 form
    got = fp8_block_gemv_triton(aq, a_s, wq, row_scales_for_scaled_mm(w_s), torch.float32, block_n, target, step)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    want = fp8_weight_only_gemv_ref(x, wq, w_s, out_dtype=torch.float32)  # weight-only form: x as it is
    got = fp8_block_gemv_triton(x, None, wq, row_scales_for_scaled_mm(w_s), torch.float32, block_n, target, step)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_gemv_refuses_more_rows_than_it_unrolls():
    from fxrewrite.kernels.fp8_gemv import GEMV_MAX_M

    w = torch.zeros(8, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=f"at most {GEMV_MAX_M} rows"):
        fp8_block_gemv_triton(torch.zeros(GEMV_MAX_M + 1, 128), None, w, torch.ones(8, 1))


def test_quant_writes_outer_major_scales(interpret, monkeypatch):
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    x = torch.randn(3, 256)
    _, s_ref = per_token_group_quant_fp8_ref(x)
    for column_major in (False, True):
        _, s = mod.per_token_group_quant_fp8(x, 128, column_major_scales=column_major)
        assert s.stride() == ((1, 3) if column_major else (2, 1))
        torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)


def test_default_table_uses_the_retuned_tiles_from_m_128():
    assert mod.config_for(1).split_k and mod.config_for(1).block_m == 16
    big = mod.config_for(4096)
    assert (big.block_m, big.block_n, big.group_m, big.num_stages) == (64, 128, 8, 4)
    assert mod.config_for(4096, mod.OLD_CONFIGS).block_m == 128


def _meta_checks_blockwise_scale_layouts() -> bool:
    """torch 2.11 - 2.13's Python meta for ``_scaled_mm_v2`` mirrors ScaledBlas.cpp's 1x128 / 128x128 scale
    shape and stride checks; from 2.14 it infers the output shape only, and the C++ meta it defers to
    leaves these (SM90-only) recipes to the CUDA kernel, so nothing off a GPU refuses a wrong layout."""
    meta = {"device": "meta"}
    try:
        torch.nn.functional.scaled_mm(torch.empty(16, 256, dtype=torch.float8_e4m3fn, **meta),
                                      torch.empty(128, 256, dtype=torch.float8_e4m3fn, **meta).t(),
                                      torch.empty(16, 2, **meta), torch.nn.functional.ScalingType.BlockWise1x128,
                                      torch.empty(1, 2, **meta), torch.nn.functional.ScalingType.BlockWise128x128)
    except RuntimeError:
        return True
    return False


@pytest.mark.parametrize("m", [1, 16, 300])
@pytest.mark.parametrize("n, k", [(6144, 2560), (2560, 9728), (640, 384)])  # 384: 3 groups, padded to 4
def test_scaled_mm_layouts_pass_torch_checks(m, n, k):
    """torch's meta kernels refuse exactly what the 2026-11-30 GPU run was refused (scale_a strides at
    M = 1, scale_b transposed); these layouts pass for the block and per-row weight scales. Where the meta
    kernel no longer checks these layouts (torch >= 2.14) only the GPU run (tests/gpu/test_gpu_fp8.py) can."""
    if not _meta_checks_blockwise_scale_layouts():
        pytest.skip(f"torch {torch.__version__}: the meta kernel leaves 1x128 / 128x128 scale layouts to the "
                    "CUDA kernel (tests/gpu/test_gpu_fp8.py checks them)")
    meta = {"device": "meta"}
    a = torch.empty(m, k, dtype=torch.float8_e4m3fn, **meta)
    w = torch.empty(n, k, dtype=torch.float8_e4m3fn, **meta)
    a_s = torch.empty(m, -(-k // 128), **meta)
    blocks = weight_block_scales_for_scaled_mm(torch.empty(-(-n // 128), -(-k // 128), **meta))
    assert fp8_scaled_mm(a, a_s, w, blocks).shape == (m, n)
    rows = row_scales_for_scaled_mm(torch.empty(n, -(-k // 128), **meta))
    assert fp8_scaled_mm(a, a_s, w, rows, per_row=True).shape == (m, n)
    with pytest.raises(RuntimeError, match="scale"):  # the old layout: row-major scales, untransposed blocks
        torch.nn.functional.scaled_mm(a, w.t(), a_s.t().contiguous().t(), torch.nn.functional.ScalingType.BlockWise1x128,
                                      torch.empty(-(-n // 128), -(-k // 128), **meta),
                                      torch.nn.functional.ScalingType.BlockWise128x128)


def test_block_scales_are_padded_to_a_multiple_of_4_groups():
    blocks = torch.arange(6.0).view(2, 3)  # N = 256, K = 384: 3 groups -> L4 = 4
    out = weight_block_scales_for_scaled_mm(blocks)
    assert out.shape == (4, 2) and out.stride() == (1, 4)
    assert torch.equal(out[:3], blocks.t())


def test_backend_choice_defaults_and_can_be_forced(monkeypatch):
    fp8_dispatch.clear()
    assert fp8_dispatch.choose(6144, 2560, 300) == "triton" and fp8_dispatch.choose(6144, 2560, 1) == "gemv:0"
    fp8_dispatch.record(6144, 2560, fp8_dispatch.bucket_of(300), ["scaled_mm", "triton:1"])
    assert fp8_dispatch.bucket_of(300) == 512 and fp8_dispatch.choose(6144, 2560, 300) == "scaled_mm"
    assert fp8_dispatch.choose(6144, 2560, 100) == "triton"
    assert fp8_dispatch.choices() == {"6144x2560@512": "scaled_mm"}
    monkeypatch.setenv("FXREWRITE_FP8_GEMM", "triton")
    assert fp8_dispatch.choose(6144, 2560, 300) == "triton" and fp8_tune.tune({(64, 128)}, "cpu") == {}
    monkeypatch.setenv("FXREWRITE_FP8_GEMM", "cublas")
    with pytest.raises(ValueError, match="FXREWRITE_FP8_GEMM='cublas'"):
        fp8_dispatch.choose(1, 1, 1)
    fp8_dispatch.clear()


def test_failing_scaled_mm_demotes_its_bucket_and_reruns(interpret, monkeypatch, caplog):
    """What a cuBLASLt refusal at an unseen token count does: the call reruns on the bucket's next
    validated backend (same result as that backend), the choice sticks, and a warning names it."""
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    fp8_dispatch.clear()
    x = torch.randn(3, 256)
    wq, w_s = per_token_group_quant_fp8_ref(torch.randn(64, 256))
    rows = row_scales_for_scaled_mm(w_s)
    fp8_dispatch.record(64, 256, fp8_dispatch.bucket_of(3), ["scaled_mm", "triton"])

    def refuse(*args, **kwargs):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmulAlgoGetHeuristic")

    monkeypatch.setattr(fp8_dispatch, "fp8_scaled_mm", refuse)
    with caplog.at_level("WARNING"):
        got = fp8_dispatch.fp8_linear_dispatch(x, wq, rows)
    torch.testing.assert_close(got, fp8_dispatch.fp8_linear_dispatch(x, wq, rows, backend="triton"))
    assert fp8_dispatch.choose(64, 256, 3) == "triton" and "now runs triton" in caplog.text
    with pytest.raises(RuntimeError, match="CUBLAS"):  # an explicit backend is never replaced
        fp8_dispatch.fp8_linear_dispatch(x, wq, rows, backend="scaled_mm")
    fp8_dispatch.clear()


def test_tuner_proves_every_decode_graph_size():
    from fxrewrite.runtime.worker.cuda_graphs import capture_sizes

    assert list(fp8_tune.GRAPH_SIZES) == capture_sizes(512)
    proven = {m for b in fp8_dispatch.BUCKETS for m in fp8_tune.sizes_to_prove(b)}
    assert set(fp8_tune.GRAPH_SIZES) <= proven
    assert all(fp8_dispatch.bucket_of(m) == b for b in fp8_dispatch.BUCKETS for m in fp8_tune.sizes_to_prove(b))
    assert fp8_tune.sizes_to_prove(8) == [5, 8] and fp8_tune.sizes_to_prove(4) == [3, 4]
    assert fp8_tune.sizes_to_prove(64) == [33, 48, 64]
    assert "scaled_mm" in fp8_tune.candidates(5120, 25600, 8) and "gemv:0" in fp8_tune.candidates(5120, 25600, 4)
    assert not any(c.startswith("gemv") for c in fp8_tune.candidates(5120, 25600, 8))


def test_linear_dispatch_on_cpu_is_the_reference():
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    wq, w_s = per_token_group_quant_fp8_ref(torch.randn(16, 256))
    assert torch.equal(fp8_dispatch.fp8_linear_dispatch(x, wq, w_s), fp8_linear(x, wq, w_s))


def test_prepared_layer_keeps_scales_outer_major_and_its_forward_matches(interpret, monkeypatch):
    """What finish_fp8_model does on an FP8 GPU, on a CPU through the Triton interpreter: the scales move
    to strides (1, N) in place (the weight loader still writes into them) and the forward, now the
    dispatched Triton kernel, equals the dequantized layer's."""
    from fxrewrite.layers.fp8_linear import SCALE_NAME, convert_linear_to_fp8, prepare_fp8_layers_for_gpu
    from fxrewrite.layers.fp8_linear import quantize_weight_fp8
    from fxrewrite.layers.linear import ReplicatedLinear

    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    monkeypatch.setenv("FXREWRITE_FP8_GEMM", "triton")  # no timing on a CPU
    layer = convert_linear_to_fp8(ReplicatedLinear(256, 80, bias=False, device="cpu"), "proj", (128, 128))
    q, blocks = quantize_weight_fp8(torch.randn(80, 256), (128, 128))
    layer.weight.weight_loader(layer.weight, q)
    scale = getattr(layer, SCALE_NAME)
    scale.weight_loader(scale, blocks)
    assert prepare_fp8_layers_for_gpu(torch.nn.Sequential(layer), torch.device("cpu"), torch.float32) == 1
    assert scale.stride() == (1, 80) and getattr(layer, SCALE_NAME) is scale
    scale.weight_loader(scale, blocks)  # weight sync writes into the new layout
    x = torch.randn(3, 256).clamp(-400, 400).to(torch.float8_e4m3fn).float()
    x[:, ::128] = 448.0
    x = x / 8  # on the FP8 grid with every group's amax 448 / 8: quantizing it rounds nothing
    want = x @ (q.float() * blocks.repeat_interleave(128, 0)[:80].repeat_interleave(128, 1)).t()
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)


def test_tuner_keeps_only_proven_backends_fastest_first(interpret, monkeypatch):
    """The tuner's ranking and proofs on a CPU (Triton interpreter; graph capture and timing faked): a
    backend that raises (torch's block-scaled matmul has no CPU kernel) or is wrong is never chosen; the
    rest are kept fastest first for demotion."""
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    monkeypatch.setattr(fp8_tune.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(fp8_tune, "capture", lambda fn: (type("G", (), {"replay": lambda self: None})(), fn()))
    fake_us = {"scaled_mm": 1.0, "gemv:1": 2.0, "triton": 3.0, "gemv:0": 4.0, "gemv:2": 5.0, "gemv:3": 6.0}
    # the timed lambdas carry their backend as the default of `name`
    monkeypatch.setattr(fp8_tune, "graph_time_us", lambda fn, reps, copies: (fn(0), fake_us[fn.__defaults__[0]])[1])
    real = fp8_dispatch.fp8_linear_dispatch

    def dispatch(x, w, w_s, group_size=128, backend=None, per_channel=False, scale_rows=1):
        out = real(x, w, w_s, group_size, backend, per_channel, scale_rows)
        return out * 2 if backend == "gemv:1" else out  # a wrong kernel: twice the right answer

    monkeypatch.setattr(fp8_tune, "fp8_linear_dispatch", dispatch)
    fp8_dispatch.clear()
    torch.manual_seed(0)
    wq = torch.randn(32, 128).div(8).to(torch.float8_e4m3fn)
    w_s = torch.rand(32, 1).add(0.5).div(448)
    wf = wq.float() * w_s
    results = fp8_tune._tune_bucket([wq], w_s, wf, 4, torch.float32)
    print(results)
    assert results["scaled_mm"].startswith("error: ")  # raised when timed (no CPU kernel for block scales)
    assert results["gemv:1"].startswith("error at M=3: ValueError: max relative error")  # wrong: refused
    assert fp8_dispatch._ranked[(32, 128, 4, False)] == ["triton", "gemv:0", "gemv:2", "gemv:3"]
    assert fp8_dispatch.choose(32, 128, 3) == "triton"
    fp8_dispatch.clear()

