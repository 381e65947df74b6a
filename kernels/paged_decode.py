"""Paged-attention decode kernel (one query token per sequence) with split-K over long contexts.

Grid (sequence, kv head, split): each program loads the G = Hq/Hkv query heads that share its
kv head as one [G, D] tile (GQA: every cached key/value is read once per kv head), walks its
partition of the context through the block table (the split count is fixed on the host, so a CUDA
graph stays valid; each sequence's partition length is its own context over that count), and
keeps an online softmax (running max m, sum l). With one split it writes the output directly;
otherwise it writes normalised partial outputs with (m, l) and :func:`_reduce_kernel` merges them
(the flash-decoding scheme). Merging in the decode kernel instead (the last split program to arrive, by an
atomic counter per sequence and kv head; commit 45f635d) measured neutral on an H200 at batch 1: Qwen3-4B
341.5 against 340.9 tokens/s, Qwen3-30B-A3B 337.7 against 337.6 (2026-12-03-decode-merge-check-twentythird.log):
one launch fewer per layer, but the merging program's tail took its place; not kept.

A CUDA graph fixes the split count from the longest context it was captured for (at batch 1 and
max_model_len 4096: 16), so a short sequence replayed in it paid for partials and the merge (an H200
profile at ~256-token contexts: the reduce was a third of the attention time). Now a sequence whose
window-limited context is at most ``single_split_len`` keys (default `_SINGLE_SPLIT_LEN`, 128) is
walked by its split 0 alone, exactly as a one-split launch walks it (bitwise), written directly, and
skipped by the merge (the merge launch stays in the graph, each of its programs returns at once);
longer sequences take the split path unchanged.
Each program's tile puts its G query heads along the MMA's M (padded to 16) or, keys-major
(:func:`~fxrewrite.kernels.attention_tile.decode_tile_keys_major`, ``FXREWRITE_DECODE_TILE``), its keys along M and
the heads along N (padded to 8): on an H200 the keys-major form runs the K and V tiles through wgmma straight from
shared memory; launched alone it was as fast at 200 x 560 and 64 x 2048 keys and 22% faster for one sequence of 32k
keys (2026-12-03-kv-cache-keys-major-twentyfifth.json), but Qwen3-4B decode in the engine was 1.5-7% slower with it
(2026-12-03-qwen3-4b-{latency,long}-decode-tile-*-twentyfifth.json), so heads-major stays the default. Over an e4m3
cache ``fp8_dots="float8"`` (``FXREWRITE_KV_FP8_DOTS``) runs both dots on FP8 tensor cores, keys-major. A value cache
stored keys-contiguous (``attention_tile.keys_contiguous``: the engine's layout for an e4m3 cache under "float8") is
read as V^T, keys-major too: on an H200 the FP8 dots over it took 113.2 us a layer at 200 x 560 keys (36 layers
replayed in a CUDA graph) against 137.4 over value rows (2026-12-03-kv-cache-fp8-v-keys-contiguous-twentysixth.json).
Semantics and arguments: :mod:`fxrewrite.kernels.paged_attention`.
"""

from __future__ import annotations

import os

import torch

from fxrewrite.kernels import env_choice
from fxrewrite.kernels.attention_tile import (FP8_DOTS, attention_tile, check_last_dim_contiguous, check_paged_args,
                                              decode_tile_keys_major, dot_dtype, float8_dots, fp16_dots, quantize_query,
                                              sinks_arg, tile_slots, value_run, widen_asm)
from fxrewrite.kernels.pdl import LINE_BYTES, early_loads, gdc_prologue, pdl_enabled, prefetch_l2
from fxrewrite.kernels.triton_utils import interpreter_ready, launch, next_power_of_2, tl, triton

__all__ = ["paged_decode_triton", "default_fp8_dots", "decode_tile", "dot_flags"]

# Programs wanted in flight (about 2 per SM on an H100/H200); splits only fill the GPU.
_TARGET_PROGRAMS = 264
# Keys of the longest context per split, at least. 64 (one tile of 64 keys a program over bf16 caches) rather than
# 128 or 256: at max_model_len 256 (the latency workload) a context of 129-256 keys is split in up to four, each
# program walking one tile (the tiles of one program are walked one after another: latency-bound at batch 1).
# H200, batch-1 latency, native, one call (2026-12-04-decode-min-partition-64-thirty-third.log), 128 -> 64: Qwen3-32B
# block-FP8 104.0 -> 105.1 tokens/s, Qwen3-4B 351.6 -> 359.8, Qwen3-30B-A3B 367.5 -> 380.9, Qwen3-32B bf16
# 62.7 -> 63.0 (256 -> 128 the session before: graph replay 9.678 -> 9.542 ms,
# 2026-12-04-qwen3-32b-fp8-block-latency-min-partition-{256,128}-thirty-second.json). Engines whose max_model_len
# exceeds 64 keys x the program target's splits (33 at batch 1, 8 kv heads) split as before.
_MIN_PARTITION = 64


def _min_partition() -> int:
    """``FXREWRITE_DECODE_MIN_PARTITION`` (a measurement switch, read once at import): keys of the longest context
    per split, at least; default `_MIN_PARTITION`. ValueError naming a value that is not a positive multiple of 16."""
    value = os.environ.get("FXREWRITE_DECODE_MIN_PARTITION", str(_MIN_PARTITION))  # the default above
    if not value.isdigit() or int(value) <= 0 or int(value) % 16:
        raise ValueError(f"FXREWRITE_DECODE_MIN_PARTITION={value!r}: expected a positive multiple of 16 (keys)")
    return int(value)


_MIN_PARTITION = _min_partition()
# Contexts up to this many keys are walked by one program even in a launch with several splits. H200,
# batch 1, 16 splits (2026-12-01-moe-kernels-qwen3-30b-a3b-direct.json): one program over 256 / 384 /
# 512 keys took 9.3 / 12.3 / 15.3 us against 6.4 us for the partials + merge, and 6.3 vs 6.4 at 128:
# one program walking a context only pays off for the shortest ones.
_SINGLE_SPLIT_LEN = 128
# Keys per tile over an FP8 cache. H200, 2026-12-02-kv-cache-fp8-with-cuda-core-variant-seventeenth.json (200 x 560,
# 64 x 2048, 8 x 8192, 1 x 32768 keys; Qwen3-4B heads): 128 keys took 126 / 136 / 80 / 120 us,
# 64 keys 130 / 136 / 122 / 137.
# FP8 tensor-core dots over a keys-contiguous value cache: 64 keys were faster in the sweep (200 x 560 / 64 x 2048:
# 116.5 / 109.5 us against 122.3 / 148.6, 2026-12-03-kv-cache-fp8-v-keys-contiguous-twentysixth.json), not in the
# engine (Qwen3-4B FP8 throughput 12,897 / 12,975 against 12,961 tok/s): 128 kept.
_BLOCK_N_FP8 = 128


# As in paged_prefill: no specialisation on what changes with the batch (split count, block-table width,
# the alignment of the packed seq_lens / query_start_loc slices).
@triton.jit(do_not_specialize=["num_splits", "bt_s0"],
            do_not_specialize_on_alignment=["seq_lens_ptr", "qsl_ptr"])
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, part_ptr, ml_ptr, sinks_ptr,
                   scale, soft_cap, sliding_window, block_size, num_splits, single_len,
                   q_s0, q_s1, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, vc_s3, bt_s0, o_s0, o_s1,
                   G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, IS_SPLIT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   FP16_DOTS: tl.constexpr, WIDEN_ASM: tl.constexpr, KEYS_MAJOR: tl.constexpr, F8_DOTS: tl.constexpr,
                   EXACT_CAST: tl.constexpr, V_RUN: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
                   LINE: tl.constexpr, ROW_LINES: tl.constexpr):
    # every program waits, even one with no work: the grid then completes after its predecessor
    if not EARLY:
        gdc_prologue(PDL)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    tok, lo, splits, start, end, active = _partition(seq_lens_ptr, qsl_ptr, seq, split, sliding_window, num_splits,
                                                     single_len, BLOCK_N, IS_SPLIT, HAS_WINDOW, V_RUN)
    bt_row = bt_ptr + seq.to(tl.int64) * bt_s0
    if EARLY:  # the metadata above came in during the previous kernel's tail; so do the first tile's K and V rows
        if active:
            _prefetch_first_tile(kc_ptr, vc_ptr, bt_row, start, end, kvh, block_size, kc_s0, kc_s1, kc_s2, vc_s0,
                                 vc_s1, vc_s2, vc_s3, HEAD_DIM, BLOCK_N, V_RUN, LINE, ROW_LINES)
        gdc_prologue(PDL)
    if active:
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        heads = kvh * G + offs_g
        gd_mask = (offs_g[:, None] < G) & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(q_ptr + tok.to(tl.int64) * q_s0 + heads[:, None] * q_s1 + offs_d[None, :], mask=gd_mask, other=0.0)
        m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - 1.0e30
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        if HAS_SINKS:  # split 0 starts from the sink logit (log2 domain, zero value); the merge weighs it in
            sink = tl.load(sinks_ptr + heads, mask=offs_g < G, other=-1.0e30) * 1.4426950408889634
            m_i = tl.where(split == 0, sink, m_i)
            l_i = tl.where((split == 0) & (offs_g < G), 1.0, l_i)
        # Every key below seq_len is causal for the last token; the window is in `start`.
        if KEYS_MAJOR:
            m_i, l_i, acc = _walk_keys_major(q, m_i, l_i, kc_ptr, vc_ptr, bt_row, start, lo, end, kvh, scale, soft_cap,
                                             block_size, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, vc_s3, offs_d,
                                             offs_d < HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_N, HAS_SOFTCAP, HAS_WINDOW,
                                             DOT_PRECISION, FP16_DOTS, WIDEN_ASM, F8_DOTS, EXACT_CAST, V_RUN)
        else:
            q = dot_dtype(q, FP16_DOTS)
            acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
            for n0 in range(start, end, BLOCK_N):
                m_i, l_i, acc = attention_tile(q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, n0, end, m_i, kvh, scale,
                                               soft_cap, sliding_window, block_size, kc_s0, kc_s1, kc_s2,
                                               vc_s0, vc_s1, vc_s2, vc_s3, offs_d, offs_d < HEAD_DIM, BLOCK_N, False,
                                               HAS_SOFTCAP, False, DOT_PRECISION, WIDEN_ASM, 0)
        _write_split(acc, m_i, l_i, out_ptr, part_ptr, ml_ptr, tok, heads, offs_d, gd_mask, offs_g < G, splits, split,
                     num_splits, G * tl.num_programs(1), o_s0, o_s1, BLOCK_D)


@triton.jit
def _partition(seq_lens_ptr, qsl_ptr, seq, split, sliding_window, num_splits, single_len, BLOCK_N: tl.constexpr,
               IS_SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr, V_RUN: tl.constexpr):
    """A decode program's share of its sequence: (query row tok, window start lo, the sequence's split count, keys
    [start, end), whether the program has work). The partition is the sequence's own context over its splits, in
    whole BLOCK_N tiles (from a multiple of V_RUN, keys below lo masked, when the tile loads runs of V_RUN keys)."""
    tok = tl.load(qsl_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - sliding_window, 0)
    splits = num_splits
    if IS_SPLIT:  # a short context: split 0 alone, as a one-split launch
        splits = tl.where(seq_len - lo <= single_len, 1, num_splits)
    base = lo
    if V_RUN > 1:
        base = lo - lo % V_RUN
    part = tl.cdiv(tl.cdiv(seq_len - base, splits), BLOCK_N) * BLOCK_N
    start = base + split * part
    end = tl.minimum(start + part, seq_len)
    return tok, lo, splits, start, end, (tl.load(qsl_ptr + seq + 1) > tok) & (split < splits)


@triton.jit
def _prefetch_first_tile(kc_ptr, vc_ptr, bt_row, start, end, kvh, block_size, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2,
                         vc_s3, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, V_RUN: tl.constexpr, LINE: tl.constexpr,
                         ROW_LINES: tl.constexpr):
    """Ask L2 for the cache lines of keys [start, min(start + BLOCK_N, end)) of kv head `kvh`: each key's row of the
    key cache and (value rows, V_RUN == 0) of the value cache, ROW_LINES lines of LINE elements each. Coherent with
    the previous kernel's write of this step's key and value (L2 is where writes land); no register result."""
    pos, n_mask, blk, slot = tile_slots(bt_row, start, end, block_size, BLOCK_N)
    cols = tl.arange(0, ROW_LINES) * LINE
    mask = n_mask[:, None] & (cols < HEAD_DIM)[None, :]
    prefetch_l2(kc_ptr + blk[:, None] * kc_s0 + slot[:, None] * kc_s1 + kvh * kc_s2 + cols[None, :], mask)
    if V_RUN == 0:
        prefetch_l2(vc_ptr + blk[:, None] * vc_s0 + slot[:, None] * vc_s1 + kvh * vc_s2 + cols[None, :] * vc_s3, mask)


@triton.jit
def _walk_keys_major(q, m_i, l_i, kc_ptr, vc_ptr, bt_row, start, lo, end, kvh, scale, soft_cap, block_size,
                     kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, vc_s3, offs_d, d_mask, BLOCK_G: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, FP16_DOTS: tl.constexpr, WIDEN_ASM: tl.constexpr,
                     F8_DOTS: tl.constexpr, EXACT_CAST: tl.constexpr, V_RUN: tl.constexpr):
    """Keys [start, end) through the keys-major tile: (m_i, l_i, acc [BLOCK_G, BLOCK_D]). Whole tiles first, then the
    one that reaches past `end` (a V^T tile masks that one apart: attention_tile.value_tile_t)."""
    q_scale = 1.0
    if F8_DOTS:
        q, q_scale = quantize_query(q, EXACT_CAST)
    else:
        q = dot_dtype(q, FP16_DOTS)
    acc = tl.zeros([BLOCK_D, BLOCK_G], dtype=tl.float32)
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        m_i, l_i, acc = decode_tile_keys_major(q, q_scale, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, n0, lo, end, kvh,
                                               scale, soft_cap, block_size, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2,
                                               vc_s3, offs_d, d_mask, BLOCK_N, HAS_SOFTCAP, HAS_WINDOW and V_RUN > 1,
                                               DOT_PRECISION, WIDEN_ASM, F8_DOTS, EXACT_CAST, V_RUN, False)
    if full_end < end:
        m_i, l_i, acc = decode_tile_keys_major(q, q_scale, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, full_end, lo, end,
                                               kvh, scale, soft_cap, block_size, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1,
                                               vc_s2, vc_s3, offs_d, d_mask, BLOCK_N, HAS_SOFTCAP,
                                               HAS_WINDOW and V_RUN > 1, DOT_PRECISION, WIDEN_ASM, F8_DOTS, EXACT_CAST,
                                               V_RUN, True)
    return m_i, l_i, tl.trans(acc)


@triton.jit
def _write_split(acc, m_i, l_i, out_ptr, part_ptr, ml_ptr, tok, heads, offs_d, gd_mask, g_mask, splits, split,
                 num_splits, num_heads, o_s0, o_s1, BLOCK_D: tl.constexpr):
    """A split's normalised output: the output rows themselves when the sequence has one split, else its
    partials ([T, Hq, num_splits, BLOCK_D] float32) and (m, l) ([T, Hq, num_splits, 2]) for the merge."""
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if splits == 1:
        tl.store(out_ptr + tok.to(tl.int64) * o_s0 + heads[:, None] * o_s1 + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gd_mask)
    else:
        row = (tok.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(part_ptr + row[:, None] * BLOCK_D + offs_d[None, :], out, mask=gd_mask)
        tl.store(ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"], do_not_specialize_on_alignment=["seq_lens_ptr", "qsl_ptr"])
def _reduce_kernel(seq_lens_ptr, qsl_ptr, out_ptr, part_ptr, ml_ptr, o_s0, o_s1, num_heads, num_splits,
                   sliding_window, single_len, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_S: tl.constexpr, HAS_WINDOW: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    if not EARLY:
        gdc_prologue(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.load(qsl_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - sliding_window, 0)
    active = (tl.load(qsl_ptr + seq + 1) > tok) & (seq_len - lo > single_len)
    if EARLY:
        gdc_prologue(PDL)
    # a short sequence was written by the decode kernel directly (its split 0 alone)
    if active:
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_mask = offs_s < num_splits
        row = (tok.to(tl.int64) * num_heads + head) * num_splits + offs_s
        m = tl.load(ml_ptr + row * 2, mask=s_mask, other=-1.0e30)
        l = tl.load(ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
        # columns >= HEAD_DIM of the partials are never written: garbage there (inf * a zero weight is
        # NaN) must not enter the sums, even in lanes the store drops. Loaded with (m, l), before the max's
        # reduction, so that the two loads share one memory latency.
        parts = tl.load(part_ptr + row[:, None] * BLOCK_D + offs_d[None, :],
                        mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
        w = tl.exp2(m - tl.max(m, axis=0)) * l  # m is in the log2 domain
        total = tl.sum(w, axis=0)
        out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
        tl.store(out_ptr + tok.to(tl.int64) * o_s0 + head * o_s1 + offs_d, out.to(out_ptr.dtype.element_ty),
                 mask=offs_d < HEAD_DIM)


def default_fp8_dots() -> str:
    """How decode dots run over an FP8 cache when the caller does not say: ``FXREWRITE_KV_FP8_DOTS`` (one of
    `FP8_DOTS`, default "float16"); ValueError naming a bad value."""
    return env_choice("FXREWRITE_KV_FP8_DOTS", "float16", FP8_DOTS)


DECODE_TILES = ("heads", "keys")


def decode_tile() -> str:
    """``FXREWRITE_DECODE_TILE``: which side of the decode tile's MMA the keys take when the caller does not say
    (`keys_major`): "heads" (default: the query heads are M) or "keys" (the keys are M, the heads N); ValueError
    naming a bad value."""
    return env_choice("FXREWRITE_DECODE_TILE", "heads", DECODE_TILES)


def dot_flags(query: torch.Tensor, key_cache: torch.Tensor, fp8_dots: str) -> dict[str, bool | int]:
    """The decode kernel's dot constexprs for `fp8_dots` (FP16_DOTS, WIDEN_ASM, F8_DOTS, EXACT_CAST): "float8"
    takes FP8 tensor cores only over an e4m3 cache under a half-precision query, else the default fp16 dots."""
    f8 = float8_dots(query, key_cache, fp8_dots)
    if fp8_dots == "float8" and not f8:
        fp8_dots = "float16"
    return dict(FP16_DOTS=fp16_dots(query, key_cache, fp8_dots), WIDEN_ASM=widen_asm(query, key_cache, fp8_dots),
                F8_DOTS=f8, EXACT_CAST=f8 and interpreter_ready())


def _num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Splits per (sequence, kv head): enough programs to fill the GPU, partitions of the longest
    context >= _MIN_PARTITION tokens. Depends only on host ints, so a CUDA graph captured with
    max_seq_len stays valid (shorter sequences divide their own context by the same count)."""
    max_splits = max(1, -(-max_seq_len // _MIN_PARTITION))
    return min(max_splits, max(1, -(-_TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads))))


def paged_decode_triton(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                        max_query_len, max_seq_len, scale, sliding_window=None, soft_cap=None, sinks=None,
                        *, block_n: int | None = None, num_splits: int | None = None, num_warps: int = 4,
                        num_stages: int = 2, single_split_len: int = _SINGLE_SPLIT_LEN, fp8_dots: str | None = None,
                        keys_major: bool | None = None, static_metadata: bool = False):
    """Decode launch (every sequence has at most one query token). ``max_seq_len`` must bound every
    seq_len (it sizes the split-K grid). Keyword-only knobs are for tests and the benchmark
    (``single_split_len``: contexts up to this many tokens skip the split and the merge; 0: never; ``fp8_dots``:
    see :mod:`fxrewrite.kernels.attention_tile`, None: :func:`default_fp8_dots`; ``block_n``: keys per tile, None:
    `_BLOCK_N_FP8` for an FP8 cache, else 64; ``keys_major``: the keys along the MMA's M, the query heads along its N,
    always so with FP8 dots (:func:`~fxrewrite.kernels.attention_tile.decode_tile_keys_major`), None:
    :func:`decode_tile`), and for the engine: ``static_metadata``, its promise that block_tables, seq_lens and
    query_start_loc were not written by the kernel launched just before this one; under PDL both kernels then read
    them, and the decode kernel asks L2 for its first tile of keys and values, before waiting for that kernel
    (`fxrewrite.kernels.pdl.early_loads`)."""
    check_paged_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    dots = dot_flags(query, key_cache, fp8_dots or default_fp8_dots())
    block_n = block_n or (_BLOCK_N_FP8 if key_cache.element_size() == 1 else 64)
    if max_query_len > 1:
        raise ValueError(f"paged_decode_triton: max_query_len={max_query_len}; expected 1 (use the prefill kernel)")
    check_last_dim_contiguous(query, key_cache)
    v_run = value_run(value_cache, block_n)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], key_cache.shape[2]
    # every query token belongs to a sequence, so every row is written; contiguous (the compiled op's fake)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0 or num_tokens == 0:
        return out
    splits = num_splits if num_splits is not None else _num_splits(num_seqs, num_kv_heads, max_seq_len)
    group, block_d = num_heads // num_kv_heads, max(16, next_power_of_2(head_dim))
    # a keys-contiguous value cache is read as V^T, the keys-major tile's operand
    keys_major = dots["F8_DOTS"] or v_run > 0 or (decode_tile() == "keys" if keys_major is None else keys_major)
    part = ml = out
    if splits > 1:
        part = torch.empty((num_tokens, num_heads, splits, block_d), dtype=torch.float32, device=query.device)
        ml = torch.empty((num_tokens, num_heads, splits, 2), dtype=torch.float32, device=query.device)
    pdl = pdl_enabled(query.device)
    early = early_loads(pdl, static_metadata)
    line = LINE_BYTES // key_cache.element_size()
    launch(_decode_kernel, (num_seqs, num_kv_heads, splits), query.device, pdl)(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, part, ml, sinks_arg(sinks, out),
        float(scale), float(soft_cap or 0.0), int(sliding_window or 0), key_cache.shape[1], splits, single_split_len,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), value_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        # the heads are the MMA's N keys-major (>= 8), its M otherwise (>= 16)
        G=group, HEAD_DIM=head_dim, BLOCK_G=max(8 if keys_major else 16, next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=block_n,
        IS_SPLIT=splits > 1, HAS_SOFTCAP=soft_cap is not None, HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None, DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        KEYS_MAJOR=keys_major, V_RUN=v_run, PDL=pdl, EARLY=early, LINE=line,
        ROW_LINES=next_power_of_2(-(-head_dim // line)), num_warps=num_warps, num_stages=num_stages, **dots)
    if splits > 1:
        launch(_reduce_kernel, (num_seqs, num_heads), query.device, pdl)(
            seq_lens, query_start_loc, out, part, ml, out.stride(0), out.stride(1), num_heads, splits,
            int(sliding_window or 0), single_split_len, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_S=next_power_of_2(splits), HAS_WINDOW=sliding_window is not None, PDL=pdl, EARLY=early,
            num_warps=4)
    return out


def decode_warmup_cases(num_kv_heads: int, max_model_len: int) -> list[tuple[int, int]]:
    """(num_seqs, max_seq_len) pairs whose eager decode launches build every specialisation of these
    kernels a serving engine can reach: one split, and several with the reduce's BLOCK_S at each power
    of two of the split count. num_splits, the block-table stride and the alignment of the length
    pointers are not specialised (the kernels' do_not_specialize...), so nothing else varies. One sequence reaches every split count a larger batch
    can (`_num_splits` only lowers the cap as num_seqs grows); a context of (s-1)*_MIN_PARTITION+1
    tokens gives s splits up to that cap."""
    limit = _num_splits(1, num_kv_heads, max_model_len)
    cases = {}
    for splits in range(1, limit + 1):
        cases.setdefault(next_power_of_2(splits), (1, min(max_model_len, (splits - 1) * _MIN_PARTITION + 1)))
    return sorted(cases.values())
