"""Rotary: reference vs transformers' apply_rotary_pos_emb (neox) and a complex-number form
(GPT-J); kernel (q and k in one pass, in place) vs reference."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from fxrewrite.kernels.rotary import rotary_embedding, rotary_embedding_ref, rotary_embedding_triton


def make_cache(max_pos: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def test_ref_neox_matches_transformers():
    pos, cache = torch.tensor([0, 5, 17, 3]), make_cache(32, 16)
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    cos, sin = cache[pos].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]  # HF: [B, T, D]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = rotary_embedding_ref(pos, q.flatten(1), k, 16, cache, True)
    assert torch.equal(got_q.view(4, 4, 16), want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1))


def test_ref_gptj_partial_matches_complex_rotation():
    pos, cache = torch.tensor([1, 9, 30]), make_cache(32, 8)
    q = torch.randn(3, 2, 12)
    got, none = rotary_embedding_ref(pos, q, None, 12, cache, False)
    angle = torch.polar(torch.ones(3, 4), torch.atan2(cache[pos, 4:], cache[pos, :4]))
    want = torch.view_as_real(torch.view_as_complex(q[..., :8].reshape(3, 2, 4, 2)) * angle[:, None]).flatten(-2)
    assert none is None
    torch.testing.assert_close(got[..., :8], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[..., 8:], q[..., 8:])


def test_ref_rejects_bad_cache():
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_embedding_ref(torch.tensor([0]), torch.randn(1, 8), None, 8, torch.randn(4, 10), True)


@pytest.mark.parametrize("neox,rotary_dim", [(True, 16), (False, 16), (True, 8), (False, 12)])
def test_kernel_matches_ref(interpret, neox, rotary_dim):
    pos, cache = torch.randint(0, 64, (2, 3)), make_cache(64, rotary_dim)
    qkv = torch.randn(2, 3, (4 + 2 + 2) * 16)
    q, k = qkv[..., : 4 * 16], qkv[..., 4 * 16: 6 * 16]  # strided views, like a split qkv output
    want_q, want_k = rotary_embedding_ref(pos, q, k, 16, cache, neox)
    got_q, got_k = rotary_embedding_triton(pos, q, k, 16, cache, neox)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("neox", [True, False])
def test_kernel_into_separate_outputs(interpret, neox):
    """query_out / key_out: the rotated heads written there (any token / head strides), the inputs untouched, as the
    reference writes them; a partial rotary or outputs unlike the inputs are refused."""
    pos, cache = torch.randint(0, 64, (3,)), make_cache(64, 16)
    qkv = torch.randn(3, (4 + 2 + 2) * 16)
    q, k = qkv[:, : 4 * 16].view(3, 4, 16), qkv[:, 4 * 16: 6 * 16].view(3, 2, 16)
    before = qkv.clone()
    outs = torch.empty(4, 3, 16).transpose(0, 1), torch.empty(3, 2, 16)  # token-major and head-major layouts
    got_q, got_k = rotary_embedding_triton(pos, q, k, 16, cache, neox, query_out=outs[0], key_out=outs[1])
    assert got_q is outs[0] and got_k is outs[1] and torch.equal(qkv, before)
    want_q, want_k = rotary_embedding_ref(pos, q, k, 16, cache, neox)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    ref_outs = torch.empty(3, 4, 16), torch.empty(3, 2, 16)
    rotary_embedding_ref(pos, q, k, 16, cache, neox, query_out=ref_outs[0], key_out=ref_outs[1])
    assert torch.equal(ref_outs[0], want_q) and torch.equal(ref_outs[1], want_k)
    for bad in (dict(query_out=outs[0]), dict(query_out=outs[0].double(), key_out=outs[1])):
        with pytest.raises(ValueError, match="query_out"):
            rotary_embedding_triton(pos, q, k, 16, cache, neox, **bad)
    with pytest.raises(ValueError, match="rotary_dim == head_size"):
        rotary_embedding_ref(pos, q, k, 16, make_cache(64, 8), neox, query_out=q.clone(), key_out=k.clone())


@pytest.mark.gpu
@pytest.mark.parametrize("neox", [True, False])
def test_kernel_matches_ref_gpu(cuda, neox):
    tokens, cache = 4096, make_cache(8192, 128).to(cuda)
    pos = torch.randint(0, 8192, (tokens,), device=cuda)
    q = torch.randn(tokens, 32 * 128, device=cuda, dtype=torch.bfloat16)
    k = torch.randn(tokens, 8 * 128, device=cuda, dtype=torch.bfloat16)
    want_q, want_k = rotary_embedding_ref(pos, q, k, 128, cache, neox)
    got_q, got_k = rotary_embedding(pos, q, k, 128, cache, neox)
    # one bf16 ulp at |x| < 8 (2**-5): the reference rounds x * cos and x * sin before the sum, the kernel once,
    # so where the two products cancel a result may differ by a whole ulp of the products
    torch.testing.assert_close(got_q, want_q, rtol=2e-2, atol=2**-5)
    torch.testing.assert_close(got_k, want_k, rtol=2e-2, atol=2**-5)
    q2, k2 = torch.randn_like(q), torch.randn_like(k)
    inputs = q2.clone(), k2.clone()
    in_place = rotary_embedding_triton(pos, *inputs, 128, cache, neox)
    outs = rotary_embedding_triton(pos, q2, k2, 128, cache, neox, query_out=torch.empty_like(q2),
                                   key_out=torch.empty_like(k2))
    assert torch.equal(outs[0], in_place[0]) and torch.equal(outs[1], in_place[1])  # the same kernel, other outputs
