"""FP8 KV cache (`kv_cache_dtype="fp8"`): the cache write clamps to the format's range and rounds as torch's
cast does (kernel bitwise the reference); the attention kernels widen FP8 keys and values to the query's
dtype, so over an FP8 cache they equal exact attention over the dequantized cache."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxrewrite.kernels import paged_decode, paged_prefill
from fxrewrite.kernels.attention_tile import keys_contiguous
from fxrewrite.kernels.paged_attention import paged_attention_ref
from fxrewrite.kernels.reshape_and_cache import reshape_and_cache_ref, reshape_and_cache_triton

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
MIXED = [(13, 1), (9, 6), (0, 11), (21, 1), (35, 7)]
DECODE = [(13, 1), (0, 1), (40, 1)]


def _write_case(dtype, num_tokens=9, num_blocks=6, block_size=4, heads=3, dim=16, representable=False):
    """K/V * 40 with three values beyond the FP8 range; `representable`: the rest already FP8 values."""
    gen = torch.Generator().manual_seed(11)
    key = torch.randn(num_tokens, heads, dim, generator=gen) * 40
    value = torch.randn(num_tokens, heads, dim, generator=gen) * 40
    if representable:
        key, value = (t.clamp(-240, 240).to(dtype).float() for t in (key, value))
    limit = torch.finfo(dtype).max
    key[0, 0, :3] = torch.tensor([4 * limit, -1e6, 1.5 * limit])  # beyond the format's range
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[1] = -1
    caches = [torch.zeros(num_blocks, block_size, heads, dim, dtype=dtype) for _ in "kv"]
    return key, value, caches[0], caches[1], slots


@pytest.mark.parametrize("dtype", FP8)
def test_ref_write_clamps_then_rounds(dtype):
    key, value, kc, vc, slots = _write_case(dtype)
    reshape_and_cache_ref(key, value, kc, vc, slots)
    limit = torch.finfo(dtype).max
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(kc[s // 4, s % 4].float(), key[t].clamp(-limit, limit).to(dtype).float())
            assert torch.equal(vc[s // 4, s % 4].float(), value[t].clamp(-limit, limit).to(dtype).float())
    assert not kc.float().isnan().any() and kc.float().abs().max() == limit


@pytest.mark.parametrize("dtype", FP8)
def test_kernel_write_matches_ref_bitwise(interpret, dtype):
    """Values the cache holds exactly, and out-of-range ones (clamped): triton's CPU interpreter rounds float32
    to FP8 wrongly (1.99 -> 1.0: the mantissa carry is lost), so rounding is checked on the GPU only."""
    key, value, kc, vc, slots = _write_case(dtype, representable=True)
    kc2, vc2 = kc.clone(), vc.clone()
    reshape_and_cache_ref(key, value, kc, vc, slots)
    reshape_and_cache_triton(key, value, kc2, vc2, slots)
    assert torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc2.view(torch.uint8))
    vc_t = keys_contiguous(torch.zeros_like(vc))  # each block's keys contiguous: the same values land
    reshape_and_cache_triton(key, value, kc2, vc_t, slots)
    assert torch.equal(vc.view(torch.uint8), vc_t.contiguous().view(torch.uint8))


def _fp8_batch(paged_batch, specs, dtype, seed):
    """A float32-query batch whose caches are FP8, and the same batch with the caches dequantized to float32."""
    batch = paged_batch(specs, 4, 2, 16, 8, seed=seed)
    fp8 = dataclasses.replace(batch, key_cache=(batch.key_cache * 3).to(dtype), value_cache=batch.value_cache.to(dtype))
    wide = dataclasses.replace(fp8, key_cache=fp8.key_cache.float(), value_cache=fp8.value_cache.float())
    return fp8, wide


@pytest.mark.parametrize("dtype", FP8)
def test_reference_reads_the_dequantized_cache(paged_batch, dtype):
    fp8, wide = _fp8_batch(paged_batch, MIXED, dtype, seed=3)
    torch.testing.assert_close(paged_attention_ref(*fp8.args(), 0.3), paged_attention_ref(*wide.args(), 0.3),
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernel_over_fp8_cache(interpret, paged_batch, dtype, splits):
    fp8, wide = _fp8_batch(paged_batch, DECODE, dtype, seed=4)
    got = paged_decode.paged_decode_triton(*fp8.args(), 0.3, None, None, block_n=16, num_splits=splits,
                                           single_split_len=0)
    torch.testing.assert_close(got, paged_attention_ref(*wide.args(), 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", FP8)
def test_prefill_kernel_over_fp8_cache(interpret, paged_batch, dtype):
    fp8, wide = _fp8_batch(paged_batch, MIXED, dtype, seed=5)
    got = paged_prefill.paged_prefill_triton(*fp8.args(), 0.3, 6, 2.5, block_m=16, block_n=16)
    torch.testing.assert_close(got, paged_attention_ref(*wide.args(), 0.3, 6, 2.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fp8_dots", ["float16", "query"])
def test_half_precision_query_over_fp8_cache(interpret, paged_batch, fp8_dots):
    """An fp16 query (bf16 dots are wrong in the interpreter; the GPU test covers bf16): the dots in fp16 or
    in the query's dtype, decode and prefill, within fp16 rounding of the reference."""
    for specs, kernel, knobs in ((DECODE, paged_decode.paged_decode_triton, dict(block_n=16, num_splits=2)),
                                 (MIXED, paged_prefill.paged_prefill_triton, dict(block_m=16, block_n=16))):
        fp8, wide = _fp8_batch(paged_batch, specs, torch.float8_e4m3fn, seed=7)
        fp8 = dataclasses.replace(fp8, query=fp8.query.half())
        got = kernel(*fp8.args(), 0.3, fp8_dots=fp8_dots, **knobs)
        want = paged_attention_ref(*dataclasses.replace(wide, query=fp8.query).args(), 0.3)
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


def float8_dots_reference(batch, scale: float, block_n: int) -> torch.Tensor:
    """What `fp8_dots="float8"` computes, in torch (float32): per sequence and head the query scaled by its amax /
    448 and rounded to e4m3, scores over the dequantized keys times that scale, the online softmax over tiles of
    `block_n` keys with each tile's probabilities x 256 rounded to e4m3 before the product with the values (one
    split: the whole context in one program)."""
    def e4m3(x):
        return x.to(torch.float8_e4m3fn).float()

    out = torch.zeros(batch.query.shape, dtype=torch.float32, device=batch.query.device)
    block_size, group = batch.key_cache.shape[1], batch.query.shape[1] // batch.key_cache.shape[2]
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        tok = int(batch.query_start_loc[seq])
        blocks = batch.block_tables[seq, :-(-seq_len // block_size)].long()
        keys = batch.key_cache[blocks].flatten(0, 1)[:seq_len].float()
        values = batch.value_cache[blocks].flatten(0, 1)[:seq_len].float()
        for head in range(batch.query.shape[1]):
            q = batch.query[tok, head].float()
            q_scale = q.abs().max().clamp_min(1e-30) / 448
            q8 = e4m3(q / q_scale)
            m, l, acc = torch.tensor(-1e30), torch.tensor(0.0), torch.zeros_like(q)
            for n0 in range(0, seq_len, block_n):
                k, v = keys[n0:n0 + block_n, head // group], values[n0:n0 + block_n, head // group]
                s = (k @ q8) * q_scale * scale
                m_new = torch.maximum(m, s.max())
                p = torch.exp(s - m_new)
                alpha = torch.exp(m - m_new)
                l, acc, m = l * alpha + p.sum(), acc * alpha + (e4m3(p * 256) @ v) / 256, m_new
            out[tok, head] = acc / l
    return out


def test_float8_dots_decode_matches_its_torch_form(interpret, paged_batch):
    """`fp8_dots="float8"` (e4m3 query and probabilities for FP8 tensor-core dots) equals its torch form within the
    fp16 output's rounding; against exact attention over the dequantized cache its error is e4m3's (0.08 here,
    where fp16 dots are within 2e-3: the 3-bit mantissa of the query and the probabilities)."""
    fp8, wide = _fp8_batch(paged_batch, DECODE, torch.float8_e4m3fn, seed=9)
    fp8 = dataclasses.replace(fp8, query=fp8.query.half())
    got = paged_decode.paged_decode_triton(*fp8.args(), 0.3, fp8_dots="float8", block_n=16, num_splits=1)
    torch.testing.assert_close(got.float(), float8_dots_reference(fp8, 0.3, 16), rtol=2e-3, atol=2e-3)
    want = paged_attention_ref(*dataclasses.replace(wide, query=fp8.query).args(), 0.3)
    torch.testing.assert_close(got, want, rtol=0.15, atol=0.15)
    split = paged_decode.paged_decode_triton(*fp8.args(), 0.3, fp8_dots="float8", block_n=16, num_splits=3,
                                             single_split_len=0)
    torch.testing.assert_close(split, want, rtol=0.15, atol=0.15)


def test_float8_dots_fall_back_to_fp16_dots_over_e5m2():
    """FP8 tensor-core dots are for e4m3 caches under a half-precision query; otherwise `fp8_dots="float8"` gives
    the default dots' flags (not the slower dots in the query's dtype)."""
    bf16_query, f32_query = torch.zeros(1, 4, 16, dtype=torch.bfloat16), torch.zeros(1, 4, 16)
    e4m3, e5m2 = (torch.zeros(2, 8, 2, 16, dtype=d) for d in FP8)
    assert paged_decode.dot_flags(bf16_query, e4m3, "float8")["F8_DOTS"]
    for query, cache in ((bf16_query, e5m2), (f32_query, e4m3)):
        assert paged_decode.dot_flags(query, cache, "float8") == paged_decode.dot_flags(query, cache, "float16")
    assert paged_decode.dot_flags(bf16_query, e5m2, "float16")["FP16_DOTS"]


def test_unknown_fp8_dots_is_refused(paged_batch):
    fp8, _ = _fp8_batch(paged_batch, DECODE, torch.float8_e4m3fn, seed=8)
    with pytest.raises(ValueError, match="fp8_dots='bf16'"):
        paged_decode.paged_decode_triton(*fp8.args(), 0.3, fp8_dots="bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FP8)
def test_fp8_cache_kernels_gpu(cuda, paged_batch, dtype):
    """bf16 queries over an FP8 cache on the GPU: write bitwise the reference; decode and prefill within bf16
    rounding of the reference over the dequantized cache."""
    key, value, kc, vc, slots = (t.to(cuda) for t in _write_case(dtype, 4096, 2048, 16, 8, 128))
    kc2, vc2 = kc.clone(), vc.clone()
    reshape_and_cache_ref(key.bfloat16(), value.bfloat16(), kc, vc, slots)
    reshape_and_cache_triton(key.bfloat16(), value.bfloat16(), kc2, vc2, slots)
    assert torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc2.view(torch.uint8))
    for specs, kernel in ((DECODE, paged_decode.paged_decode_triton), (MIXED, paged_prefill.paged_prefill_triton)):
        batch = paged_batch(specs, 32, 8, 128, 16, torch.bfloat16, cuda, seed=6)
        fp8 = dataclasses.replace(batch, key_cache=batch.key_cache.to(dtype), value_cache=batch.value_cache.to(dtype))
        wide = dataclasses.replace(fp8, key_cache=fp8.key_cache.bfloat16(), value_cache=fp8.value_cache.bfloat16())
        for fp8_dots in ("float16", "query"):
            torch.testing.assert_close(kernel(*fp8.args(), 0.1, fp8_dots=fp8_dots),
                                       paged_attention_ref(*wide.args(), 0.1), rtol=2e-2, atol=2e-2)
        # a keys-contiguous value cache (NaN past the sequences): decode keys-major, prefill V^T transposed
        fp8_vt = dataclasses.replace(fp8, value_cache=keys_contiguous(fp8.value_cache))
        torch.testing.assert_close(kernel(*fp8_vt.args(), 0.1), paged_attention_ref(*wide.args(), 0.1), rtol=2e-2,
                                   atol=2e-2)
    batch = paged_batch(DECODE + [(700, 1)], 32, 8, 128, 16, torch.bfloat16, cuda, seed=8)
    for cache_dtype in (torch.bfloat16, dtype):  # keys along the MMA's M (wgmma, the heads its N)
        cached = dataclasses.replace(batch, key_cache=batch.key_cache.to(cache_dtype),
                                     value_cache=batch.value_cache.to(cache_dtype))
        wide = dataclasses.replace(cached, key_cache=cached.key_cache.bfloat16(),
                                   value_cache=cached.value_cache.bfloat16())
        # the value cache also with each block's keys contiguous (read as V^T; NaN past the sequences there too)
        v_layouts = (cached, dataclasses.replace(cached, value_cache=keys_contiguous(cached.value_cache)))
        for (block_n, num_splits), layout in itertools.product(((64, 1), (128, None)), v_layouts):
            torch.testing.assert_close(
                paged_decode.paged_decode_triton(*layout.args(), 0.1, keys_major=True, block_n=block_n,
                                                 num_splits=num_splits),
                paged_attention_ref(*wide.args(), 0.1), rtol=2e-2, atol=2e-2)
    if dtype == torch.float8_e4m3fn:  # FP8 tensor-core dots (wgmma), one split and the split path
        batch = paged_batch(DECODE + [(700, 1)], 32, 8, 128, 16, torch.bfloat16, cuda, seed=7)
        fp8 = dataclasses.replace(batch, key_cache=batch.key_cache.to(dtype), value_cache=batch.value_cache.to(dtype))
        fp8_vt = dataclasses.replace(fp8, value_cache=keys_contiguous(fp8.value_cache))
        for block_n, layout in itertools.product((64, 128), (fp8, fp8_vt)):
            got = paged_decode.paged_decode_triton(*layout.args(), 0.1, fp8_dots="float8", block_n=block_n,
                                                   num_splits=1)
            torch.testing.assert_close(got.float(), float8_dots_reference(fp8, 0.1, block_n), rtol=2e-2, atol=2e-2)
            split = paged_decode.paged_decode_triton(*layout.args(), 0.1, fp8_dots="float8", block_n=block_n)
            wide = dataclasses.replace(fp8, key_cache=fp8.key_cache.bfloat16(), value_cache=fp8.value_cache.bfloat16())
            torch.testing.assert_close(split, paged_attention_ref(*wide.args(), 0.1), rtol=0.1, atol=0.1)



@pytest.mark.parametrize("cache", ["fp8e4nv", "fp8e5"])
def test_fp8_cache_kernels_compile_for_sm90(cache):
    """The FP8 paths (the fused q/k-norm + RoPE + cache write included) through triton's real compiler for an
    H100/H200 (sm90), with no GPU here (in a fresh process: this one may run triton's interpreter): a construct the
    interpreter accepts and the compiler rejects fails here. The decode tile widens K/V in registers (inline PTX), so no 8-bit value comes back from shared memory a
    byte at a time (attention_tile's docstring); with `fp8_dots="float8"` both dots are e4m3 wgmma."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.kernels.sm90_compile", cache], env=env, capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    decode = json.loads(done.stdout.splitlines()[-1])
    assert decode["widened_in_ptx"] and decode["byte_loads_from_shared"] == 0, decode
    if cache == "fp8e4nv":  # fp8_dots="float8": wgmma on e4m3 operands for both dots, nothing widened
        assert decode["float8_dots_mma"] == ["wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3",
                                             "widened: 0"], decode
        # V^T from a keys-contiguous value cache: the full tiles' K and V both by cp.async, no byte loads, and far
        # fewer shared-memory stores than the V rows' transposition through registers takes
        rows, v_t = decode["float8_v_loads"]["0"], decode["float8_v_loads"]["16"]
        assert v_t["byte_loads"] == 0 and v_t["cp_async"] == 2 * rows["cp_async"], decode
        assert v_t["shared_stores"] * 4 < rows["shared_stores"], decode
