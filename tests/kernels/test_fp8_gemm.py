"""Block-scaled FP8 GEMM and per-token-group quantization: references against float32 math, kernels
against the references (Triton interpreter on a CPU; real sizes in tests/gpu/test_gpu_fp8.py)."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels import fp8_gemm as mod
from fxrewrite.kernels.fp8_gemm import (
    FP8_DTYPE,
    fp8_block_gemm,
    fp8_block_gemm_ref,
    fp8_linear,
    per_token_group_quant_fp8_ref,
)
from fxrewrite.layers.fp8_linear import quantize_weight_fp8


def _exact_input(m: int, k: int, group: int = 128) -> torch.Tensor:
    """Values already on the FP8 grid, each group's amax exactly 448 * 2^-3: quantizing them rounds
    nothing (triton's interpreter rounds some float32 -> e4m3 carries differently from torch)."""
    q = torch.randn(m, k).clamp(-400, 400).to(FP8_DTYPE).float()
    q[:, ::group] = 448.0
    return q / 8


def test_quant_ref_round_trips_within_fp8_precision():
    x = torch.randn(6, 300) * torch.logspace(-2, 2, 300)
    q, s = per_token_group_quant_fp8_ref(x, 128)
    assert q.dtype == FP8_DTYPE and s.shape == (6, 3)  # a partial last group of 44
    back = q.float() * s.repeat_interleave(128, 1)[:, :300]
    torch.testing.assert_close(back, x, rtol=0.0625, atol=s.max().item() * 0.01)
    assert torch.equal(s[:, 0], x[:, :128].abs().amax(1) / 448)


def test_quant_kernel_matches_ref(interpret, monkeypatch):
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    x = _exact_input(5, 256 + 64)
    q, s = mod.per_token_group_quant_fp8(x, 128)
    q_ref, s_ref = per_token_group_quant_fp8_ref(x, 128)
    assert torch.equal(q.float(), q_ref.float())
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)


def test_gemm_ref_is_dequantized_matmul():
    a, w = torch.randn(4, 256), torch.randn(96, 256)
    aq, a_s = per_token_group_quant_fp8_ref(a)
    wq, w_blocks = quantize_weight_fp8(w, (128, 128))
    w_s = w_blocks.repeat_interleave(128, 0)[:96]
    want = (aq.float() * a_s.repeat_interleave(128, 1)) @ (wq.float() * w_s.repeat_interleave(128, 1)).t()
    torch.testing.assert_close(fp8_block_gemm_ref(aq, a_s, wq, w_s, out_dtype=torch.float32), want)
    # and close to the unquantized product (e4m3 has 3 mantissa bits: ~6% per element, averaging out)
    rel = (want - a @ w.t()).norm() / (a @ w.t()).norm()
    assert rel < 0.05


@pytest.mark.parametrize("m, n, k", [(1, 64, 128), (5, 70, 200), (20, 130, 384), (100, 130, 256)])
def test_gemm_kernel_matches_ref(interpret, m, n, k):
    aq, a_s = per_token_group_quant_fp8_ref(torch.randn(m, k))
    wq, w_s = per_token_group_quant_fp8_ref(torch.randn(n, k))  # per-row scales are valid w_s too
    want = fp8_block_gemm_ref(aq, a_s, wq, w_s, out_dtype=torch.float32)
    got = mod.fp8_block_gemm_triton(aq, a_s, wq, w_s, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_split_k_only_for_small_m_with_few_tiles():
    assert mod._split_k(num_tiles=80, groups=200, m=1) == 3  # Qwen3-32B down_proj at decode
    assert mod._split_k(num_tiles=80, groups=2, m=1) == 2  # never more splits than groups
    assert mod._split_k(num_tiles=800, groups=40, m=1) == 1
    assert mod._split_k(num_tiles=4, groups=40, m=512) == 1


def test_gemm_rejects_mismatched_scales():
    aq, a_s = per_token_group_quant_fp8_ref(torch.randn(2, 256))
    wq, w_s = per_token_group_quant_fp8_ref(torch.randn(8, 256))
    with pytest.raises(ValueError, match=r"w_s \[N, 2\]"):
        fp8_block_gemm(aq, a_s, wq, w_s[:, :1])


def test_fp8_linear_keeps_leading_dims_and_dtype():
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    wq, w_s = per_token_group_quant_fp8_ref(torch.randn(16, 256))
    out = fp8_linear(x, wq, w_s)
    assert out.shape == (2, 3, 16) and out.dtype == torch.bfloat16
