"""Fused q/k norm + rotary + KV-cache write: the reference is the unfused pair (qk_norm_rope, then
reshape_and_cache of the rotated key); the kernel (interpreter, strided slices of a fused QKV output)
matches it, writes only the mapped slots, and refuses bad shapes."""

from __future__ import annotations

import functools

import pytest
import torch

from fxrewrite.kernels.attention_tile import keys_contiguous
from fxrewrite.kernels.qk_norm_rope import qk_norm_rope_ref, qk_norm_rope_triton
from fxrewrite.kernels.qk_norm_rope_cache import qk_norm_rope_cache, qk_norm_rope_cache_ref, qk_norm_rope_cache_triton
from fxrewrite.kernels.reshape_and_cache import reshape_and_cache_ref, reshape_and_cache_triton, to_cache_dtype
from tests.kernels.test_rotary import make_cache


def _case(tokens=7, hq=4, hkv=2, dim=16, rotary_dim=16, blocks=5, block_size=4, dtype=torch.float32,
          cache_dtype=None, device="cpu"):
    qkv = torch.randn(tokens, (hq + 2 * hkv) * dim, device=device).to(dtype)
    q, k, v = qkv[:, : hq * dim], qkv[:, hq * dim: (hq + hkv) * dim], qkv[:, (hq + hkv) * dim:]
    pos = torch.randint(0, 64, (tokens,), device=device)
    weights = (torch.rand(dim, device=device) + 0.5).to(dtype), (torch.rand(dim, device=device) + 0.5).to(dtype)
    slots = torch.randperm(blocks * block_size, device=device)[:tokens]
    slots[2] = -1  # padding / already cached: nothing written
    caches = [torch.full((blocks, block_size, hkv, dim), float("nan"), device=device).to(cache_dtype or dtype)
              for _ in "kv"]
    return pos, q, k, v, weights, make_cache(64, rotary_dim).to(device), caches, slots


def test_ref_is_the_unfused_pair():
    torch.manual_seed(0)
    pos, q, k, v, (qw, kw), cache, (kc, vc), slots = _case()
    want_q, want_k = qk_norm_rope_ref(pos, q, k, qw, kw, 1e-6, 16, cache, True)
    want_kc, want_vc = kc.clone(), vc.clone()
    reshape_and_cache_ref(want_k.view(7, 2, 16), v.view(7, 2, 16), want_kc, want_vc, slots)
    got_q, got_k = qk_norm_rope_cache_ref(pos, q, k, v, qw, kw, 1e-6, 16, cache, True, kc, vc, slots)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(kc.nan_to_num(7.0), want_kc.nan_to_num(7.0)) and torch.equal(vc.nan_to_num(7.0),
                                                                                      want_vc.nan_to_num(7.0))
    assert int((~kc.isnan()).all(-1).all(-1).sum()) == 6  # the six mapped slots, nothing else


@pytest.mark.parametrize("neox,rotary_dim,heads", [(True, 16, (4, 2)), (False, 16, (4, 1)), (True, 8, (3, 3)),
                                                    (False, 12, (2, 2))])
def test_kernel_matches_ref(interpret, neox, rotary_dim, heads):
    torch.manual_seed(1)
    pos, q, k, v, (qw, kw), cache, (kc, vc), slots = _case(hq=heads[0], hkv=heads[1], rotary_dim=rotary_dim)
    kc2, vc2 = kc.clone(), vc.clone()
    want_q, want_k = qk_norm_rope_cache_ref(pos, q.clone(), k.clone(), v, qw, kw, 1e-6, 16, cache, neox, kc2, vc2,
                                            slots)
    got_q, got_k = qk_norm_rope_cache_triton(pos, q, k, v, qw, kw, 1e-6, 16, cache, neox, kc, vc, slots)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc, kc2, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.equal(vc.nan_to_num(7.0), vc2.nan_to_num(7.0))  # values are copied bit for bit


def test_kernel_other_cache_dtype_rounds_like_the_pair(interpret):
    """A float32 cache under bfloat16 activations: the key is rounded to bf16 first, as the pair does."""
    torch.manual_seed(2)
    pos, q, k, v, (qw, kw), cache, (kc, vc), slots = _case(dtype=torch.bfloat16, cache_dtype=torch.float32)
    kc2, vc2 = kc.clone(), vc.clone()
    _, want_k = qk_norm_rope_cache_ref(pos, q.clone(), k.clone(), v, qw, kw, 1e-6, 16, cache, True, kc2, vc2, slots)
    _, got_k = qk_norm_rope_cache_triton(pos, q, k, v, qw, kw, 1e-6, 16, cache, True, kc, vc, slots)
    mapped = slots[slots >= 0]
    assert torch.equal(kc.view(-1, 2, 16)[mapped], got_k.view(7, 2, 16)[slots >= 0].float())


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("keys_contiguous_values", [False, True])
def test_kernel_fp8_cache_writes_what_the_pair_writes(interpret, cache_dtype, keys_contiguous_values):
    """An FP8 cache (values beyond its range among them) under bfloat16 activations, fused in one launch: the key
    rounded to bf16, then clamped and cast, bitwise what the unfused triton pair writes (the interpreter's FP8 cast
    is not torch's, so the pair, not the reference, is the comparison here; the GPU test checks torch's)."""
    torch.manual_seed(4)
    pos, q, k, v, (qw, kw), cache, (kc, vc), slots = _case(dtype=torch.bfloat16, cache_dtype=cache_dtype)
    v *= 1000  # some beyond e4m3's +-448
    if keys_contiguous_values:
        vc = keys_contiguous(vc)
    kc2, vc2 = kc.clone(), vc.clone()
    want_q, want_k = qk_norm_rope_triton(pos, q.clone(), k.clone(), qw, kw, 1e-6, 16, cache, True)
    reshape_and_cache_triton(want_k.view(7, 2, 16), v.view(7, 2, 16), kc2, vc2, slots)
    got_q, got_k = qk_norm_rope_cache_triton(pos, q, k, v, qw, kw, 1e-6, 16, cache, True, kc, vc, slots)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    for got, want in ((kc, kc2), (vc, vc2)):
        assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def test_kernel_rejects_bad_shapes(interpret):
    pos, q, k, v, (qw, kw), cache, (kc, vc), slots = _case()
    with pytest.raises(ValueError, match="caches"):
        qk_norm_rope_cache_triton(pos, q, k, v, qw, kw, 1e-6, 16, cache, True, kc[..., :8], vc[..., :8], slots)
    with pytest.raises(ValueError, match="weights"):
        qk_norm_rope_cache_triton(pos, q, k, v, qw[:8], kw, 1e-6, 16, cache, True, kc, vc, slots)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
def test_kernel_matches_ref_gpu(cuda, cache_dtype):
    """bf16, and an e4m3 cache: there the cache holds torch's clamp + cast of the kernel's own rotated key."""
    torch.manual_seed(3)
    pos, q, k, v, (qw, kw), cache, (kc, vc), slots = _case(
        tokens=512, hq=32, hkv=8, dim=128, rotary_dim=128, blocks=64, block_size=16, dtype=torch.bfloat16,
        cache_dtype=cache_dtype, device=cuda)
    pos = pos % 64
    kc2, vc2 = kc.clone(), vc.clone()
    q0, k0, kc0, vc0 = q.clone(), k.clone(), kc.clone(), vc.clone()
    want_q, want_k = qk_norm_rope_cache_ref(pos, q.clone(), k.clone(), v, qw, kw, 1e-6, 128, cache, True, kc2, vc2,
                                            slots)
    got_q, got_k = qk_norm_rope_cache(pos, q, k, v, qw, kw, 1e-6, 128, cache, True, kc, vc, slots)
    # one bf16 ulp at |x| in [4, 8), as in test_qk_norm_rope's GPU test
    torch.testing.assert_close(got_q, want_q, rtol=2e-2, atol=3.2e-2)
    torch.testing.assert_close(got_k, want_k, rtol=2e-2, atol=3.2e-2)
    mapped = slots[slots >= 0]  # the cache holds exactly the kernel's own rotated key
    as_cached = functools.partial(to_cache_dtype, dtype=kc.dtype)
    assert torch.equal(kc.view(-1, 8, 128)[mapped].view(torch.uint8),
                       as_cached(got_k.view(512, 8, 128)[slots >= 0]).view(torch.uint8))
    assert torch.equal(vc.view(-1, 8, 128)[mapped].view(torch.uint8),
                       as_cached(v.reshape(512, 8, 128)[slots >= 0]).view(torch.uint8))
    # positions, slots, cos / sin and weights read before the PDL wait (kernels/pdl.py early_loads): the same bits
    early_q, early_k = qk_norm_rope_cache(pos, q0, k0, v, qw, kw, 1e-6, 128, cache, True, kc0, vc0, slots,
                                          static_metadata=True)
    assert torch.equal(early_q, got_q) and torch.equal(early_k, got_k)
    assert torch.equal(kc0.view(torch.uint8), kc.view(torch.uint8)) and torch.equal(vc0.view(torch.uint8),
                                                                                    vc.view(torch.uint8))
