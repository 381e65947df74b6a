"""Fused q/k RMSNorm + rotary: reference vs transformers' Qwen3 attention prologue, kernel (in place,
strided slices of a fused QKV output) vs reference."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

from fxrewrite.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_ref, qk_norm_rope_triton
from tests.kernels.test_rotary import make_cache


def _split_qkv(tokens: int, hq: int, hkv: int, dim: int, dtype=torch.float32, device="cpu"):
    qkv = torch.randn(tokens, (hq + 2 * hkv) * dim, dtype=dtype, device=device)
    return qkv[:, : hq * dim], qkv[:, hq * dim : (hq + hkv) * dim]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_matches_transformers_qwen3(dtype):
    torch.manual_seed(0)
    tokens, hq, hkv, dim = 5, 4, 2, 16
    pos, cache = torch.randint(0, 64, (tokens,)), make_cache(64, dim)
    q, k = _split_qkv(tokens, hq, hkv, dim, dtype)
    q_norm, k_norm = Qwen3RMSNorm(dim, 1e-6).to(dtype), Qwen3RMSNorm(dim, 1e-6).to(dtype)
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5)
        k_norm.weight.uniform_(0.5, 1.5)
    cos, sin = cache[pos].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[None].to(dtype), torch.cat([sin, sin], -1)[None].to(dtype)
    hf_q = q_norm(q.view(1, tokens, hq, dim)).transpose(1, 2)  # transformers: [B, H, T, D]
    hf_k = k_norm(k.reshape(1, tokens, hkv, dim)).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(hf_q, hf_k, cos, sin)
    got_q, got_k = qk_norm_rope_ref(pos, q, k, q_norm.weight.detach(), k_norm.weight.detach(), 1e-6, dim, cache)
    assert torch.equal(got_q.view(tokens, hq, dim), want_q[0].transpose(0, 1))
    assert torch.equal(got_k.view(tokens, hkv, dim), want_k[0].transpose(0, 1))


@pytest.mark.parametrize("neox,rotary_dim,heads", [(True, 16, (4, 2)), (False, 16, (4, 1)), (True, 8, (3, 3)),
                                                    (False, 12, (4, 2))])
def test_kernel_matches_ref(interpret, neox, rotary_dim, heads):
    torch.manual_seed(1)
    tokens, dim = 6, 16
    pos, cache = torch.randint(0, 64, (tokens,)), make_cache(64, rotary_dim)
    q, k = _split_qkv(tokens, *heads, dim)
    qw, kw = torch.rand(dim) + 0.5, torch.rand(dim) + 0.5
    want_q, want_k = qk_norm_rope_ref(pos, q, k, qw, kw, 1e-6, dim, cache, neox)
    got_q, got_k = qk_norm_rope_triton(pos, q, k, qw, kw, 1e-6, dim, cache, neox)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)


def test_kernel_rejects_bad_weights(interpret):
    q, k = _split_qkv(2, 2, 1, 8)
    with pytest.raises(ValueError, match="weights"):
        qk_norm_rope_triton(torch.tensor([0, 1]), q, k, torch.ones(4), torch.ones(8), 1e-6, 8, make_cache(4, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("neox", [True, False])
def test_kernel_matches_ref_gpu(cuda, neox):
    tokens, dim = 4096, 128
    pos, cache = torch.randint(0, 8192, (tokens,), device=cuda), make_cache(8192, dim).to(cuda)
    q, k = _split_qkv(tokens, 32, 8, dim, torch.bfloat16, cuda)
    qw = torch.rand(dim, device=cuda, dtype=torch.bfloat16) + 0.5
    kw = torch.rand(dim, device=cuda, dtype=torch.bfloat16) + 0.5
    want_q, want_k = qk_norm_rope_ref(pos, q, k, qw, kw, 1e-6, dim, cache, neox)
    got_q, got_k = qk_norm_rope(pos, q, k, qw, kw, 1e-6, dim, cache, neox)
    # The reference rounds each rotary product to bf16, the kernel once: up to one bf16 ulp apart at
    # |x| in [4, 8) (0.03125), where normalised heads times weights up to 1.5 land.
    torch.testing.assert_close(got_q, want_q, rtol=2e-2, atol=3.2e-2)
    torch.testing.assert_close(got_k, want_k, rtol=2e-2, atol=3.2e-2)
