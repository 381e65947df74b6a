"""reshape_and_cache: reference writes exactly the mapped slots; kernel matches it bit for bit."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref, reshape_and_cache_triton


def _case(num_tokens=9, num_blocks=6, block_size=4, heads=2, dim=8, device="cpu", dtype=torch.float32):
    key = torch.randn(num_tokens, heads, dim, device=device).to(dtype)
    value = torch.randn(num_tokens, heads, dim, device=device).to(dtype)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[1] = -1  # padding / already cached
    caches = [torch.full((num_blocks, block_size, heads, dim), float("nan"), device=device).to(dtype) for _ in "kv"]
    return key, value, caches[0], caches[1], slots


def test_ref_writes_mapped_slots_only():
    key, value, kc, vc, slots = _case()
    reshape_and_cache_ref(key, value, kc, vc, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(kc[s // 4, s % 4], key[t]) and torch.equal(vc[s // 4, s % 4], value[t])
    assert int((~kc.isnan()).all(-1).all(-1).sum()) == (slots >= 0).sum()


def test_ref_rejects_mismatched_cache():
    key, value, kc, vc, slots = _case()
    with pytest.raises(ValueError, match="caches"):
        reshape_and_cache_ref(key, value, kc[..., :4], vc[..., :4], slots)


@pytest.mark.parametrize("transposed", [False, True])
def test_kernel_matches_ref(interpret, transposed):
    key, value, kc, vc, slots = _case(heads=3, dim=12)
    if transposed:  # the HF attention path passes [1, Hkv, T, D] tensors transposed to [T, Hkv, D]
        key, value = key.transpose(0, 1).contiguous().transpose(0, 1), value.transpose(0, 1).contiguous().transpose(0, 1)
    kc2, vc2 = kc.clone(), vc.clone()
    reshape_and_cache_ref(key, value, kc, vc, slots)
    reshape_and_cache_triton(key, value, kc2, vc2, slots)
    assert torch.equal(kc.nan_to_num(7.0), kc2.nan_to_num(7.0))
    assert torch.equal(vc.nan_to_num(7.0), vc2.nan_to_num(7.0))


@pytest.mark.gpu
def test_kernel_matches_ref_gpu(cuda):
    key, value, kc, vc, slots = _case(4096, 2048, 16, 8, 128, cuda, torch.bfloat16)
    kc2, vc2 = kc.clone(), vc.clone()
    reshape_and_cache_ref(key, value, kc, vc, slots)
    reshape_and_cache(key, value, kc2, vc2, slots)
    assert torch.equal(kc.nan_to_num(7.0), kc2.nan_to_num(7.0))
    assert torch.equal(vc.nan_to_num(7.0), vc2.nan_to_num(7.0))
