"""Paged attention: the reference vs dense attention with an explicit position mask; the decode
(split-K) and prefill kernels vs the reference. Caches are NaN outside the sequences' slots."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fxrewrite.kernels import paged_attention as paged_attention_module
from fxrewrite.kernels import attention_tile, paged_decode, paged_prefill
from fxrewrite.kernels.paged_attention import paged_attention, paged_attention_ref

# (cached tokens, query tokens): decode, chunked prefill / prefix hit, fresh prefill, one-token prefill
MIXED = [(13, 1), (9, 6), (0, 11), (21, 1), (35, 7)]
DECODE = [(13, 1), (0, 1), (40, 1)]


def dense_attention(batch, scale, sliding_window=None, soft_cap=None, compute_dtype=torch.float32):
    """Per sequence: K/V read slot by slot through the block table, mask from positions. Computed in
    `compute_dtype`; returned in the query's dtype, or in float64 when computed in float64."""
    bs = batch.key_cache.shape[1]
    outs = []
    for b in range(batch.seq_lens.shape[0]):
        seq_len = int(batch.seq_lens[b])
        q0, q1 = int(batch.query_start_loc[b]), int(batch.query_start_loc[b + 1])
        pos = torch.arange(seq_len, device=batch.query.device)
        blocks = batch.block_tables[b].long()[pos // bs]
        k = batch.key_cache[blocks, pos % bs].to(compute_dtype)
        v = batch.value_cache[blocks, pos % bs].to(compute_dtype)
        q_pos = pos[seq_len - (q1 - q0):]
        mask = pos[None] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= pos[None] > q_pos[:, None] - sliding_window
        q = batch.query[q0:q1].to(compute_dtype).transpose(0, 1)[None]
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if soft_cap is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        else:  # Gemma 2 eager: tanh cap on scaled scores, then mask, softmax
            rep = q.shape[1] // k.shape[1]
            s = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) * scale
            s = (torch.tanh(s / soft_cap) * soft_cap).masked_fill(~mask, float("-inf"))
            o = s.softmax(-1) @ v.repeat_interleave(rep, 1)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs).to(torch.float64 if compute_dtype == torch.float64 else batch.query.dtype)


def assert_close_to_exact(got, batch, scale, sliding_window=None, soft_cap=None, tol=0.05):
    """Per query token: max |got - exact| over heads and dims <= tol * the exact row's standard deviation,
    where `exact` is attention in float64 on the same (rounded) inputs. An absolute tolerance cannot
    work at long contexts: the output of attention over n random keys spreads like 1/sqrt(n) (about
    0.009 at 32k), so a kernel dropping the last 10% of the keys (an error of about a third of the
    spread) stays under any absolute tolerance that bf16 rounding of short contexts needs."""
    exact = dense_attention(batch, scale, sliding_window, soft_cap, compute_dtype=torch.float64)
    err = (got.double() - exact).abs().flatten(1).amax(1)
    spread = exact.flatten(1).std(1)
    bad = (err > tol * spread).nonzero().flatten().tolist()
    assert not bad, (f"{len(bad)} of {len(err)} query tokens off by more than {tol} x their spread; worst "
                     f"{(err / spread).max().item():.3g} x (token {int((err / spread).argmax())})")


def _truncated(batch, fraction=0.1):
    """The same batch with the last `fraction` of each context dropped: what a kernel that stops early sees."""
    import dataclasses

    lens = batch.seq_lens - (batch.seq_lens.float() * fraction).ceil().int()
    return dataclasses.replace(batch, seq_lens=lens.clamp(min=1))


@pytest.mark.parametrize("window,cap", [(None, None), (6, None), (None, 4.0), (5, 2.5)])
def test_ref_matches_dense(paged_batch, window, cap):
    batch = paged_batch(MIXED, 4, 2, 16, 4)
    got = paged_attention_ref(*batch.args(), 0.25, window, cap)
    assert not got.isnan().any()
    torch.testing.assert_close(got, dense_attention(batch, 0.25, window, cap), rtol=1e-5, atol=1e-5)


def test_ref_rejects_bad_shapes(paged_batch):
    batch = paged_batch(MIXED, 4, 2, 16, 4)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        paged_attention_ref(batch.query[:, :3], *batch.args()[1:], 1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_ref(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                            batch.seq_lens, batch.query_start_loc[:-1], 6, 22, 1.0)


@pytest.mark.parametrize("heads,dim,window,cap,splits", [((4, 2), 16, None, None, None), ((4, 1), 24, 9, 3.0, 3),
                                                     ((4, 2), 16, None, None, 8), ((4, 1), 24, 5, None, 8)])
@pytest.mark.parametrize("keys_major", [False, True])
def test_decode_kernel_matches_ref(interpret, paged_batch, heads, dim, window, cap, splits, keys_major):
    batch = paged_batch(DECODE, *heads, dim, 8, seed=1)
    want = paged_attention_ref(*batch.args(), 0.3, window, cap)
    got = paged_decode.paged_decode_triton(*batch.args(), 0.3, window, cap, block_n=16, num_splits=splits,
                                           single_split_len=0,  # these short contexts too take the split path
                                           keys_major=keys_major)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 10])
def test_short_contexts_skip_the_split_bitwise(interpret, paged_batch, window):
    """In a launch with several splits (a CUDA graph captured for a long context), a sequence of at
    most single_split_len tokens (after the window) is computed by split 0 alone and written directly:
    bitwise what a one-split launch gives; a longer one is bitwise what it was without the shortcut."""
    batch = paged_batch([(20, 1), (47, 1), (5, 1)], 4, 2, 16, 8, seed=5)  # contexts 21, 48, 6
    single = paged_decode.paged_decode_triton(*batch.args(), 0.3, window, block_n=16, num_splits=1)
    split = paged_decode.paged_decode_triton(*batch.args(), 0.3, window, block_n=16, num_splits=3, single_split_len=0)
    got = paged_decode.paged_decode_triton(*batch.args(), 0.3, window, block_n=16, num_splits=3, single_split_len=21)
    short = [0, 2] if window is None else [0, 1, 2]  # with the window every context is <= 10 keys
    long_ = [i for i in range(3) if i not in short]
    assert torch.equal(got[short], single[short]) and torch.equal(got[long_], split[long_])
    torch.testing.assert_close(got, paged_attention_ref(*batch.args(), 0.3, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,dim,window,cap", [((4, 2), 16, None, None), ((2, 2), 24, 7, 3.0)])
def test_prefill_kernel_matches_ref(interpret, paged_batch, heads, dim, window, cap):
    batch = paged_batch(MIXED, *heads, dim, 4, seed=2)
    want = paged_attention_ref(*batch.args(), 0.3, window, cap)
    got = paged_prefill.paged_prefill_triton(*batch.args(), 0.3, window, cap, block_m=16, block_n=16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernels_in_half_precision(interpret, paged_batch):
    """fp16 exercises the low-precision casts (bf16 dots are wrong in triton's CPU interpreter,
    so bf16 is covered by the GPU tests)."""
    batch = paged_batch(DECODE, 4, 2, 32, 8, torch.float16, seed=3)
    want = paged_attention_ref(*batch.args(), 0.2)
    got = paged_decode.paged_decode_triton(*batch.args(), 0.2, block_n=16, num_splits=2)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    batch = paged_batch(MIXED, 4, 2, 32, 8, torch.float16, seed=4)
    want = paged_attention_ref(*batch.args(), 0.2)
    got = paged_prefill.paged_prefill_triton(*batch.args(), 0.2, block_m=16, block_n=16)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


def test_dispatch_picks_decode_or_prefill(interpret, paged_batch, monkeypatch):
    calls = []
    monkeypatch.setattr(paged_attention_module, "paged_decode_triton", lambda *a, **kw: calls.append(("decode", kw)))
    monkeypatch.setattr(paged_attention_module, "paged_prefill_triton", lambda *a: calls.append(("prefill", {})))
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    paged_attention(*paged_batch(DECODE, 2, 1, 16, 4).args(), 1.0)
    paged_attention(*paged_batch(DECODE, 2, 1, 16, 4).args(), 1.0, static_metadata=True)  # the engine's promise
    paged_attention(*paged_batch(MIXED, 2, 1, 16, 4).args(), 1.0)
    assert calls == [("decode", {"static_metadata": False}), ("decode", {"static_metadata": True}), ("prefill", {})]


@pytest.mark.gpu
def test_decode_kernel_matches_ref_gpu(cuda, paged_batch):
    specs = [(32767, 1), (100, 1), (5000, 1), (0, 1), (16383, 1), (77, 1), (2048, 1), (9, 1)]
    batch = paged_batch(specs, 32, 8, 128, 16, torch.bfloat16, cuda)
    assert_close_to_exact(paged_attention(*batch.args(), 128 ** -0.5), batch, 128 ** -0.5)
    for block_n in (64, 128):  # keys along the MMA's M (wgmma, the heads its N)
        got = paged_decode.paged_decode_triton(*batch.args(), 128 ** -0.5, keys_major=True, block_n=block_n)
        assert_close_to_exact(got, batch, 128 ** -0.5)
    # metadata read and the first tile prefetched before the PDL wait (kernels/pdl.py early_loads): the same result
    plain = paged_attention(*batch.args(), 128 ** -0.5)
    assert torch.equal(paged_attention(*batch.args(), 128 ** -0.5, static_metadata=True), plain)
    with pytest.raises(AssertionError, match="spread"):  # the check catches a kernel that stops early
        assert_close_to_exact(paged_attention(*_truncated(batch).args(), 128 ** -0.5), batch, 128 ** -0.5)


@pytest.mark.gpu
def test_short_contexts_skip_the_split_gpu(cuda, paged_batch):
    """Qwen3-30B-A3B heads (32 / 4 x 128), bf16: in a 16-split launch, contexts <= single_split_len tokens
    give the one-split launch's output, longer ones bitwise the plain split path's. Short rows within one bf16
    ulp of the largest output, not bitwise: the one-split launch is another compilation of the kernel
    (IS_SPLIT off), and the H200 runs of 2026-12-02 found 171 of 8192 elements apart, by at most 4.9e-4 (one
    ulp at 0.12)."""
    short = paged_decode._SINGLE_SPLIT_LEN
    batch = paged_batch([(short, 1), (100, 1), (3000, 1), (short + 1, 1)], 32, 4, 128, 16, torch.bfloat16, cuda)
    scale = 128 ** -0.5
    single = paged_decode.paged_decode_triton(*batch.args(), scale, num_splits=1)
    split = paged_decode.paged_decode_triton(*batch.args(), scale, num_splits=16, single_split_len=0)
    got = paged_decode.paged_decode_triton(*batch.args(), scale, num_splits=16)
    torch.testing.assert_close(got[:2], single[:2], rtol=0, atol=2 ** -7 * single[:2].abs().max().item())
    assert torch.equal(got[2:], split[2:])
    assert_close_to_exact(got, batch, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,dim,window,cap", [((16, 8), 128, None, None), ((8, 4), 256, 1024, 50.0)])
def test_prefill_kernel_matches_ref_gpu(cuda, paged_batch, heads, dim, window, cap):
    specs = [(0, 2048), (4096, 512), (300, 1), (0, 17), (1000, 1000)]
    batch = paged_batch(specs, *heads, dim, 16, torch.bfloat16, cuda)
    assert_close_to_exact(paged_attention(*batch.args(), dim ** -0.5, window, cap), batch, dim ** -0.5, window, cap)


@pytest.mark.gpu
def test_decode_with_window_and_cap_gpu(cuda, paged_batch):
    batch = paged_batch([(8000, 1), (50, 1), (4095, 1)], 8, 4, 256, 16, torch.bfloat16, cuda)
    assert_close_to_exact(paged_attention(*batch.args(), 256 ** -0.5, 4096, 50.0), batch, 256 ** -0.5, 4096, 50.0)
    keys_major = paged_decode.paged_decode_triton(*batch.args(), 256 ** -0.5, 4096, 50.0, keys_major=True)
    assert_close_to_exact(keys_major, batch, 256 ** -0.5, 4096, 50.0)
    truncated = paged_attention(*_truncated(batch).args(), 256 ** -0.5, 4096, 50.0)
    with pytest.raises(AssertionError, match="spread"):
        assert_close_to_exact(truncated, batch, 256 ** -0.5, 4096, 50.0)


@pytest.mark.parametrize("window,cap", [(None, None), (9, 3.0)])
def test_ref_batched_decode_matches_per_sequence_loop(paged_batch, monkeypatch, window, cap):
    from fxrewrite.kernels import paged_attention as mod

    batch = paged_batch(DECODE + [(3, 1)], 6, 2, 8, 4, seed=5)
    batched = paged_attention_ref(*batch.args(), 0.5, window, cap)
    monkeypatch.setattr(mod, "_BATCHED_DECODE_ELEMENTS", 0)
    looped = paged_attention_ref(*batch.args(), 0.5, window, cap)
    assert not batched.isnan().any()
    torch.testing.assert_close(batched, looped, rtol=1e-5, atol=1e-6)


class _GarbageTorch:
    """`torch` as paged_decode sees it, except that `empty` returns float buffers full of inf: the
    never-written lanes of the split-K partials must not reach the result (issue 15 item 8)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("inf")) if t.is_floating_point() else t


def test_decode_split_reduce_ignores_unwritten_lanes(interpret, paged_batch, monkeypatch):
    import warnings

    monkeypatch.setattr(paged_decode, "torch", _GarbageTorch())
    batch = paged_batch(DECODE, 4, 1, 24, 8, seed=1)  # head_dim 24 < BLOCK_D 32; some splits empty
    want = paged_attention_ref(*batch.args(), 0.3, 9, 3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = paged_decode.paged_decode_triton(*batch.args(), 0.3, 9, 3.0, block_n=16, num_splits=3,
                                               single_split_len=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 0.05)])
def test_exact_check_catches_a_truncated_context(interpret, paged_batch, dtype, tol):
    """The check the GPU tests use, on the interpreter: the decode kernel passes it, and the same
    kernel given contexts 10% short (as if it stopped early) fails it."""
    batch = paged_batch([(700, 1), (333, 1), (64, 1)], 4, 2, 16, 8, dtype, seed=7)
    got = paged_decode.paged_decode_triton(*batch.args(), 0.25, block_n=32, num_splits=3)
    assert_close_to_exact(got, batch, 0.25, tol=tol)
    short = paged_decode.paged_decode_triton(*_truncated(batch).args(), 0.25, block_n=32, num_splits=3)
    with pytest.raises(AssertionError, match="spread"):
        assert_close_to_exact(short, batch, 0.25, tol=tol)


@pytest.mark.parametrize("window,cap", [(None, None), (6, None), (5, 2.5)])
def test_ref_in_query_chunks_matches_one_shot(paged_batch, monkeypatch, window, cap):
    """A budget of 3 score rows x 4 heads x the context splits every prefill into chunks (each against only the
    keys it can see): the same result as the one-shot reference and dense attention, float32 1e-5."""
    from fxrewrite.kernels import paged_attention as mod

    batch = paged_batch(MIXED + [(0, 29), (17, 12)], 4, 2, 16, 4, seed=6)
    one_shot = paged_attention_ref(*batch.args(), 0.25, window, cap)
    monkeypatch.setattr(mod, "SCORE_CHUNK_ELEMENTS", 3 * 4 * 48)
    chunked = paged_attention_ref(*batch.args(), 0.25, window, cap)
    assert not chunked.isnan().any()
    torch.testing.assert_close(chunked, one_shot, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked, dense_attention(batch, 0.25, window, cap), rtol=1e-5, atol=1e-5)


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the most elements any op output held in new memory (not a view of, or an in-place write to,
    an input such as the KV cache); also used by tests/runtime/test_engine.py."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {a.untyped_storage().data_ptr() for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


def test_long_prefill_never_builds_the_full_score_matrix(paged_batch):
    """A 2048-token prompt (4 heads): no op output reaches [Hq, L, L] (16M scores), the largest is one query
    chunk's `SCORE_CHUNK_ELEMENTS`; the result is SDPA's causal attention."""
    from fxrewrite.kernels.paged_attention import SCORE_CHUNK_ELEMENTS

    length, heads = 2048, 4
    batch = paged_batch([(0, length)], heads, 2, 8, 16, seed=8)
    with LargestTensor() as mode:
        got = paged_attention_ref(*batch.args(), 8 ** -0.5)
    assert mode.largest <= SCORE_CHUNK_ELEMENTS < heads * length * length
    q = batch.query.transpose(0, 1)[None]
    k, v = (c[batch.block_tables[0, : length // 16].long()].flatten(0, 1).transpose(0, 1)[None]
            for c in (batch.key_cache, batch.value_cache))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=8 ** -0.5, enable_gqa=True)
    torch.testing.assert_close(got, want[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size,block_n,window,cap,splits", [(8, 16, None, None, 1), (16, 16, 9, 3.0, 3),
                                                                   (4, 16, None, None, 8), (8, 32, 5, None, 2),
                                                                   (5, 16, 7, None, 3), (24, 16, None, None, 2)])
def test_decode_over_a_keys_contiguous_value_cache(interpret, paged_batch, block_size, block_n, window, cap, splits):
    """A value cache that holds each block's keys contiguous (read as V^T by the keys-major tile) gives the reference's
    output; the slots past each sequence are NaN there too, so a key the tile must zero and not just weigh 0 shows."""
    batch = paged_batch([(13, 1), (0, 1), (40, 1), (31, 1)], 4, 2, 16, block_size, seed=5)
    want = paged_attention_ref(*batch.args(), 0.3, window, cap)
    args = list(batch.args())
    args[2] = attention_tile.keys_contiguous(batch.value_cache)
    assert attention_tile.value_run(args[2], block_n) == math.gcd(block_size, block_n)  # 1 for an odd block size
    got = paged_decode.paged_decode_triton(*args, 0.3, window, cap, block_n=block_n, num_splits=splits,
                                           single_split_len=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_value_cache_of_another_layout_is_refused(paged_batch):
    batch = paged_batch(DECODE, 4, 2, 16, 8)
    with pytest.raises(ValueError, match="value cache strides"):
        attention_tile.value_run(batch.value_cache.transpose(2, 3), 16)


@pytest.mark.parametrize("block_size,window,cap", [(8, None, None), (8, 7, 3.0), (3, 5, None)])
def test_prefill_over_a_keys_contiguous_value_cache(interpret, paged_batch, block_size, window, cap):
    """Chunked prefill and prefix hits read the keys-contiguous value cache as V^T too (NaN past the sequences)."""
    batch = paged_batch(MIXED, 4, 2, 16, block_size, seed=6)
    want = paged_attention_ref(*batch.args(), 0.3, window, cap)
    args = list(batch.args())
    args[2] = attention_tile.keys_contiguous(batch.value_cache)
    got = paged_prefill.paged_prefill_triton(*args, 0.3, window, cap, block_m=16, block_n=16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_min_partition_switch(monkeypatch):
    """FXREWRITE_DECODE_MIN_PARTITION: a positive multiple of 16 keys, else an error naming the value."""
    monkeypatch.setenv("FXREWRITE_DECODE_MIN_PARTITION", "32")
    assert paged_decode._min_partition() == 32
    for bad in ("0", "100", "x"):
        monkeypatch.setenv("FXREWRITE_DECODE_MIN_PARTITION", bad)
        with pytest.raises(ValueError, match=f"FXREWRITE_DECODE_MIN_PARTITION='{bad}'"):
            paged_decode._min_partition()
