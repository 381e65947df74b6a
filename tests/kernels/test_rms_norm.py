"""RMSNorm: the reference is bit-identical to transformers' norms; the kernel matches the reference."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from fxrewrite.kernels import rms_norm as mod
from fxrewrite.kernels.rms_norm import rms_norm, rms_norm_ref



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_is_bit_identical_to_llama_and_gemma(dtype):
    x = torch.randn(3, 5, 64).to(dtype)
    llama = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    gemma = Gemma2RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        llama.weight.copy_(torch.randn(64))
        gemma.weight.copy_(torch.randn(64))
        assert torch.equal(rms_norm_ref(x, llama.weight, 1e-5), llama(x))
        assert torch.equal(rms_norm_ref(x, gemma.weight, 1e-6, offset=1.0), gemma(x))


def test_ref_residual_adds_first_in_input_dtype():
    x, res, w = torch.randn(4, 32).bfloat16(), torch.randn(4, 32).bfloat16(), torch.randn(32).bfloat16()
    out, new_res = rms_norm_ref(x, w, 1e-6, residual=res)
    assert torch.equal(new_res, res + x)
    assert torch.equal(out, rms_norm_ref(res + x, w, 1e-6))


def test_ref_rejects_bad_weight():
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm_ref(torch.randn(2, 8), torch.randn(7), 1e-6)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("with_residual", [False, True])
def test_kernel_matches_ref(interpret, offset, with_residual):
    x, w = torch.randn(3, 2, 48), torch.randn(48)
    res = torch.randn(3, 2, 48) if with_residual else None
    want = rms_norm_ref(x, w, 1e-6, res, offset)
    got = mod.rms_norm_triton(x, w, 1e-6, res, offset)
    if with_residual:
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[1], want[1])
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dispatch_forced_on_cpu(interpret, monkeypatch):
    calls = []
    monkeypatch.setattr(mod, "rms_norm_triton", lambda *a: calls.append(a) or rms_norm_ref(*a))
    x, w = torch.randn(2, 16), torch.randn(16)
    rms_norm(x, w, 1e-6)
    assert not calls
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    rms_norm(x, w, 1e-6)
    assert len(calls) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_kernel_matches_ref_gpu(cuda, offset):
    x = torch.randn(4096, 4096, device=cuda, dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.randn(4096, device=cuda, dtype=torch.bfloat16)
    want = rms_norm_ref(x, w, 1e-6, res, offset)
    got = rms_norm(x, w, 1e-6, res, offset)
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
    assert torch.equal(got[1], want[1])
