"""The decode kernel with Qwen3's prologue folded in (raw q, k, v in; kernels/decode_prologue.py) against the unfused
pair it replaces: q/k norm + rotary + cache write, then decode attention. Outputs and the written cache slots match
(the reference pair, or the Triton pair where the interpreter's FP8 cast is not torch's), whatever the split
count, tile orientation, rotary style or width; only the new token's slot is written, and only for a mapped slot."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fxrewrite.kernels import paged_attention as paged_attention_module
from fxrewrite.kernels import paged_decode
from fxrewrite.kernels.attention_tile import keys_contiguous
from fxrewrite.kernels.decode_prologue import DecodePrologue, apply_prologue
from fxrewrite.kernels.paged_attention import paged_attention, paged_attention_ref
from fxrewrite.kernels.qk_norm_rope_cache import qk_norm_rope_cache_triton
from tests.kernels.conftest import make_paged_batch
from tests.kernels.test_rotary import make_cache

CONTEXTS = [13, 0, 40, 7]  # cached tokens before each sequence's new one


def _step(hq=4, hkv=2, dim=16, rotary_dim=16, neox=True, block_size=8, dtype=torch.float32, cache_dtype=None, seed=3,
          contexts=CONTEXTS, device="cpu"):
    """A decode step: the batch (caches with the new tokens' slots NaN), its raw q [T, Hq, D] and the prologue
    (k / v as strided slices of one fused QKV output, as the engine hands them)."""
    batch = make_paged_batch([(c, 1) for c in contexts], hq, hkv, dim, block_size, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = len(contexts)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * dim, generator=gen).to(dtype)
    q, k, v = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
    positions = batch.seq_lens.long() - 1
    rows = torch.arange(tokens)
    slots = batch.block_tables[rows, positions // block_size].long() * block_size + positions % block_size
    for cache in (batch.key_cache, batch.value_cache):
        cache.view(-1, hkv, dim)[slots] = float("nan")
    if cache_dtype is not None:
        batch.key_cache, batch.value_cache = batch.key_cache.to(cache_dtype), batch.value_cache.to(cache_dtype)
    weights = [(torch.rand(dim, generator=gen) + 0.5).to(dtype) for _ in "qk"]
    batch = dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
                                          if torch.is_tensor(getattr(batch, f.name))})
    qkv, positions, slots = qkv.to(device), positions.to(device), slots.to(device)
    weights = [w.to(device) for w in weights]
    q, k, v = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
    cos_sin = make_cache(max(contexts) + 1, rotary_dim).to(device)
    prologue = DecodePrologue(positions, *weights, 1e-6, cos_sin, neox).with_kv(
        k.view(tokens, hkv, dim), v.view(tokens, hkv, dim), slots)
    return batch, q.view(tokens, hq, dim), prologue


def _unfused(batch, query, prologue, **decode):
    """The pair the prologue replaces, on clones of the caches: (output, key cache, value cache). Triton decode
    when `decode` holds its knobs, else the references."""
    kc, vc = batch.key_cache.clone(), batch.value_cache.clone()
    args = (batch.block_tables, batch.seq_lens, batch.query_start_loc, 1, batch.max_seq_len, 0.3)
    if decode:
        q, _ = qk_norm_rope_cache_triton(prologue.positions, query.clone().flatten(1), prologue.key.clone().flatten(1),
                                         prologue.value.flatten(1), prologue.q_weight, prologue.k_weight, prologue.eps,
                                         query.shape[-1], prologue.cos_sin_cache, prologue.is_neox_style, kc, vc,
                                         prologue.slot_mapping)
        return paged_decode.paged_decode_triton(q.view(query.shape), kc, vc, *args, **decode), kc, vc
    q = apply_prologue(query, prologue, kc, vc)
    return paged_attention_ref(q, kc, vc, *args), kc, vc


def _fused(batch, query, prologue, **decode):
    kc, vc = batch.key_cache.clone(), batch.value_cache.clone()
    out = paged_decode.paged_decode_triton(query, kc, vc, batch.block_tables, batch.seq_lens, batch.query_start_loc, 1,
                                           batch.max_seq_len, 0.3, prologue=prologue, **decode)
    return out, kc, vc


def _assert_same(got, want, rtol=1e-5, atol=1e-5):
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("neox,rotary_dim,heads", [(True, 16, (4, 2)), (False, 16, (4, 1)), (True, 8, (2, 2)),
                                                    (False, 12, (6, 2))])
@pytest.mark.parametrize("splits,keys_major", [(1, False), (3, False), (8, True)])
def test_fused_matches_the_unfused_reference(interpret, neox, rotary_dim, heads, splits, keys_major):
    batch, query, prologue = _step(*heads, rotary_dim=rotary_dim, neox=neox)
    raw = query.clone()
    want = _unfused(batch, query, prologue)
    got = _fused(batch, query, prologue, block_n=16, num_splits=splits, single_split_len=0, keys_major=keys_major)
    _assert_same(got, want)
    assert torch.equal(query, raw)  # the raw query is read, not overwritten
    for cache in got[1:]:  # the new tokens' slots were written (NaN before)
        assert not cache.view(-1, heads[1], 16)[prologue.slot_mapping].isnan().any()


def test_only_the_new_tokens_mapped_slots_are_written(interpret):
    batch, query, prologue = _step()
    slots = prologue.slot_mapping.clone()
    slots[1] = -1  # e.g. a padded row of a CUDA graph: nothing written for it
    prologue = DecodePrologue(**{**prologue.__dict__, "slot_mapping": slots})
    _, kc, vc = _fused(batch, query, prologue, block_n=16, num_splits=3)
    for cache, before in ((kc, batch.key_cache), (vc, batch.value_cache)):
        changed = ~((cache == before) | (cache.isnan() & before.isnan())).view(-1, 2 * 16).all(-1)
        assert changed.nonzero().flatten().tolist() == sorted(slots[slots >= 0].tolist())


def test_half_precision_and_a_keys_contiguous_value_cache(interpret):
    batch, query, prologue = _step(dtype=torch.float16)
    want = _unfused(batch, query, prologue, block_n=16, num_splits=3, single_split_len=0)
    batch.value_cache = keys_contiguous(batch.value_cache)
    got = _fused(batch, query, prologue, block_n=16, num_splits=3, single_split_len=0)
    _assert_same(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_gets_what_the_unfused_pair_writes(interpret, cache_dtype):
    """Keys rounded to the activation dtype, then clamped and cast, values clamped and cast: as the Triton pair (the
    interpreter's FP8 cast is not torch's, so the pair, not the reference, is the comparison)."""
    batch, query, prologue = _step(dtype=torch.float16, cache_dtype=cache_dtype)
    prologue = prologue.with_kv(prologue.key, prologue.value * 1000, prologue.slot_mapping)  # some beyond the range
    want = _unfused(batch, query, prologue, block_n=16, num_splits=2)
    got = _fused(batch, query, prologue, block_n=16, num_splits=2)
    _assert_same(got[1:], want[1:], rtol=0, atol=0)
    _assert_same(got[:1], want[:1], rtol=2e-3, atol=2e-3)


def test_dispatch_runs_the_prologue_on_its_own_where_the_kernel_cannot(interpret, monkeypatch):
    """paged_attention with a prologue: fused into the Triton decode launch; a prefill step, the CPU reference or a
    cache of another float dtype run the prologue first (the same results)."""
    batch, query, prologue = _step()
    want = _unfused(batch, query, prologue)
    fused_calls = []
    original = paged_decode.paged_decode_triton

    def decode(*args, prologue=None, **kwargs):
        fused_calls.append(prologue is not None)
        return original(*args, prologue=prologue, **kwargs)
    monkeypatch.setattr(paged_attention_module, "paged_decode_triton", decode)
    for forced in ("1", "0"):
        monkeypatch.setenv("FXREWRITE_TRITON", forced)
        kc, vc = batch.key_cache.clone(), batch.value_cache.clone()
        out = paged_attention(query, kc, vc, batch.block_tables, batch.seq_lens, batch.query_start_loc, 1,
                              batch.max_seq_len, 0.3, prologue=prologue)
        _assert_same((out, kc, vc), want)
    assert fused_calls == [True]
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    kc, vc = batch.key_cache.double(), batch.value_cache.double()
    paged_attention(query, kc, vc, batch.block_tables, batch.seq_lens, batch.query_start_loc, 1, batch.max_seq_len,
                    0.3, prologue=prologue)
    assert fused_calls == [True, False]
    _assert_same((kc, vc), want[1:])


def test_a_cache_of_another_dtype_is_refused_by_the_kernel(interpret):
    batch, query, prologue = _step()
    with pytest.raises(ValueError, match="torch.float64 cache under a torch.float32 key"):
        paged_decode.paged_decode_triton(query, batch.key_cache.double(), batch.value_cache.double(),
                                         batch.block_tables, batch.seq_lens, batch.query_start_loc, 1,
                                         batch.max_seq_len, 0.3, prologue=prologue)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype,keys_major", [(None, False), (None, True), (torch.float8_e4m3fn, True)])
def test_fused_matches_the_triton_pair_gpu(cuda, cache_dtype, keys_major):
    """Qwen3-4B heads in bfloat16, contexts from one key to past the split threshold, compiled for the GPU."""
    batch, query, prologue = _step(32, 8, 128, 128, block_size=16, dtype=torch.bfloat16, cache_dtype=cache_dtype,
                                   contexts=[0, 5, 300, 2047, 130], device=cuda)
    for splits in (1, 16):
        knobs = dict(num_splits=splits, keys_major=keys_major)
        want = _unfused(batch, query, prologue, **knobs)
        got = _fused(batch, query, prologue, **knobs)
        _assert_same(got, want, rtol=1e-2, atol=1e-2)
