"""Experiment (GPU): paged decode with the next tile's keys and values loaded into registers while the current one
is multiplied, against the engine's kernel (`fxrewrite.kernels.paged_decode`), over bf16 and e4m3 caches.

Why: over an FP8 cache the engine's decode kernel reads 200 sequences x 560 keys (Qwen3-4B heads) at ~43% of the
copy bandwidth where bf16's reaches ~78% (H200, `2026-12-03-kv-cache-fp8-v-keys-contiguous-twentysixth.json`). In
its sm90 code triton streams the tile global -> shared (cp.async) -> registers -> fp16 -> shared -> MMA operand: six
bytes of shared-memory traffic per cached value (bf16: four), and the loop waits for all of its copies at its top
(``cp.async.wait_group 0``) after issuing the next tile's at its bottom. The variant here loads the tile straight
into registers (``num_stages=1``: no cp.async), widens it there and issues the next tile's loads (and, with
``bt_ahead``, the block-table entries of the tile after) before the current tile's dots, so the load latency is
covered by the program's own work rather than only by other programs on the multiprocessor.

Heads along the MMA's M (the engine's default form for these shapes), no sinks / window / soft cap / PDL.
Measured, not kept (H100, 2026-12-07-decode-{prefetch,maxnreg}-h100-sixty-first.*): the variant holds 196-255
registers a thread, so two programs fit a multiprocessor where the engine kernel fits three or four, and it ran
slower at 200 x 560 (bf16 204 against 176 us, e4m3 174 against 130); ncu put the engine's e4m3 kernel at 55% of
DRAM and 71% of L1 / shared-memory throughput, 18.75% occupancy (registers and shared memory both allow three
programs). ``--kinds maxnreg`` caps the engine kernel's registers instead: 96 gave e4m3 125 against 131 us at
200 x 560 and 137 against 82 at 8 x 8192, not a rule to keep.
``python -m fxrewrite.benchmarks.decode_prefetch --out DIR`` writes ``<date>-decode-prefetch.json``: per case and
cache dtype, the engine kernel's configs and the variant's, median us (``triton.testing.do_bench``), the relative
error against the reference over the dequantized cache, and the share of the copy bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json

import torch

from fxrewrite.benchmarks import kernels
from fxrewrite.benchmarks.common import RESULTS_DIR, environment
from fxrewrite.benchmarks.out_paths import FOLDER_HELP, results_folder
from fxrewrite.benchmarks.tool_cli import require_cuda
from fxrewrite.kernels import paged_decode
from fxrewrite.kernels.attention_tile import dot_dtype, keys_contiguous, log2_scores, tile_slots, widen, widen_asm
from fxrewrite.kernels.paged_attention import paged_attention_ref
from fxrewrite.kernels.paged_decode import (_SINGLE_SPLIT_LEN, _num_splits, _partition, _reduce_kernel,
                                            _write_split, paged_decode_triton)
from fxrewrite.kernels.triton_utils import next_power_of_2, tl, triton

CASES = [(200, 560), (64, 2048), (8, 8192), (1, 32768)]
ENGINE_CONFIGS = {"bf16": [dict(block_n=64, num_stages=2), dict(block_n=64, num_stages=1)],
                  "fp8_e4m3": [dict(block_n=128, num_stages=2), dict(block_n=64, num_stages=2),
                               dict(block_n=128, num_stages=1), dict(block_n=64, num_stages=1)]}
# The engine kernel under a register cap (triton's ``maxnreg``): its occupancy is bound by registers (ncu, H100: 166 /
# 112 a thread at 128 / 64 keys, three / four programs a multiprocessor), 96 lets five programs of 64 keys in.
MAXNREG_CONFIGS = {"bf16": [dict(block_n=64, num_stages=2, maxnreg=r) for r in (96, 80)],
                   "fp8_e4m3": [dict(block_n=64, num_stages=2, maxnreg=r) for r in (96, 80)]
                   + [dict(block_n=128, num_stages=2, maxnreg=128)]
                   + [dict(block_n=64, num_stages=2, fp8_dots="float8", maxnreg=r) for r in (None, 96, 80)]}
VARIANT_CONFIGS = [dict(block_n=n, bt_ahead=b, num_warps=w) for n in (64, 128) for b in (False, True) for w in (4,)]


@triton.jit
def _kv_tile(kc_ptr, vc_ptr, blk, slot, n_mask, kvh, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, offs_d, d_mask):
    mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(kc_ptr + blk[:, None] * kc_s0 + slot[:, None] * kc_s1 + kvh * kc_s2 + offs_d[None, :], mask=mask,
                other=0.0)
    v = tl.load(vc_ptr + blk[:, None] * vc_s0 + slot[:, None] * vc_s1 + kvh * vc_s2 + offs_d[None, :], mask=mask,
                other=0.0)
    return k, v


@triton.jit(do_not_specialize=["num_splits", "bt_s0"], do_not_specialize_on_alignment=["seq_lens_ptr", "qsl_ptr"])
def _decode_prefetch_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, part_ptr, ml_ptr, scale,
                            block_size, num_splits, single_len, q_s0, q_s1, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2,
                            bt_s0, o_s0, o_s1, G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IS_SPLIT: tl.constexpr,
                            FP16_DOTS: tl.constexpr, WIDEN_ASM: tl.constexpr, BT_AHEAD: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    tok, lo, splits, start, end, active = _partition(seq_lens_ptr, qsl_ptr, seq, split, 0, num_splits, single_len,
                                                     BLOCK_N, IS_SPLIT, False, 0)
    bt_row = bt_ptr + seq.to(tl.int64) * bt_s0
    if active:
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        heads = kvh * G + offs_g
        gd_mask = (offs_g[:, None] < G) & d_mask[None, :]
        q = tl.load(q_ptr + tok.to(tl.int64) * q_s0 + heads[:, None] * q_s1 + offs_d[None, :], mask=gd_mask, other=0.0)
        q = dot_dtype(q, FP16_DOTS)
        m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - 1.0e30
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        pos, n_mask, blk, slot = tile_slots(bt_row, start, end, block_size, BLOCK_N)
        k, v = _kv_tile(kc_ptr, vc_ptr, blk, slot, n_mask, kvh, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, offs_d,
                        d_mask)
        if BT_AHEAD:
            pos, n_mask, blk, slot = tile_slots(bt_row, start + BLOCK_N, end, block_size, BLOCK_N)
        for n0 in range(start, end, BLOCK_N):
            k_cur, v_cur = k, v
            cur_mask = (n0 + tl.arange(0, BLOCK_N)) < end
            if not BT_AHEAD:
                pos, n_mask, blk, slot = tile_slots(bt_row, n0 + BLOCK_N, end, block_size, BLOCK_N)
            # the next tile's loads go out before this tile's dots (masked off past the end: no traffic)
            k, v = _kv_tile(kc_ptr, vc_ptr, blk, slot, n_mask, kvh, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, offs_d,
                            d_mask)
            if BT_AHEAD:
                pos, n_mask, blk, slot = tile_slots(bt_row, n0 + 2 * BLOCK_N, end, block_size, BLOCK_N)
            s = log2_scores(tl.dot(q, tl.trans(widen(k_cur, q.dtype, WIDEN_ASM))), scale, 0.0, False)
            s = tl.where(cur_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vw = widen(v_cur, q.dtype, WIDEN_ASM)
            acc = acc * alpha[:, None] + tl.dot(p.to(vw.dtype), vw)
            m_i = m_new
        _write_split(acc, m_i, l_i, out_ptr, part_ptr, ml_ptr, tok, heads, offs_d, gd_mask, offs_g < G, splits, split,
                     num_splits, G * tl.num_programs(1), o_s0, o_s1, BLOCK_D)


def decode_prefetch(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                    max_seq_len, scale, *, block_n: int = 128, bt_ahead: bool = False, num_warps: int = 4):
    """The variant's launch, paged_decode_triton's contract for a plain decode batch (no sinks, window, soft cap)."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], key_cache.shape[2]
    out = torch.empty_like(query)
    splits = _num_splits(num_seqs, num_kv_heads, max_seq_len)
    group, block_d = num_heads // num_kv_heads, max(16, next_power_of_2(head_dim))
    part = ml = out
    if splits > 1:
        part = torch.empty((num_tokens, num_heads, splits, block_d), dtype=torch.float32, device=query.device)
        ml = torch.empty((num_tokens, num_heads, splits, 2), dtype=torch.float32, device=query.device)
    fp8 = key_cache.element_size() == 1
    _decode_prefetch_kernel[(num_seqs, num_kv_heads, splits)](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, part, ml, float(scale),
        key_cache.shape[1], splits, _SINGLE_SPLIT_LEN, query.stride(0), query.stride(1), key_cache.stride(0),
        key_cache.stride(1), key_cache.stride(2), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), G=group, HEAD_DIM=head_dim,
        BLOCK_G=max(16, next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n, IS_SPLIT=splits > 1,
        FP16_DOTS=fp8, WIDEN_ASM=widen_asm(query, key_cache), BT_AHEAD=bt_ahead, num_warps=num_warps, num_stages=1)
    if splits > 1:
        _reduce_kernel[(num_seqs, num_heads)](
            seq_lens, query_start_loc, out, part, ml, out.stride(0), out.stride(1), num_heads, splits, 0,
            _SINGLE_SPLIT_LEN, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=next_power_of_2(splits), HAS_WINDOW=False,
            PDL=False, EARLY=False, num_warps=4)
    return out


@contextlib.contextmanager
def _maxnreg(cap: int | None):
    """paged_decode_triton's decode kernel launched with triton's ``maxnreg`` = cap (None: as the engine does)."""
    real = paged_decode.launch

    def capped(kernel, grid, device, pdl=False):
        run = real(kernel, grid, device, pdl)
        return functools.partial(run, maxnreg=cap) if kernel is paged_decode._decode_kernel else run

    paged_decode.launch = capped if cap else real
    try:
        yield
    finally:
        paged_decode.launch = real


def _engine(*args, maxnreg: int | None = None, **cfg):
    with _maxnreg(maxnreg):
        return paged_decode_triton(*args, **cfg)


def _rows(batch: int, ctx: int, bandwidth: float, once: bool, kinds: tuple[str, ...]) -> list[dict]:
    args, seq_lens = kernels._paged_batch([(ctx - 1, 1)] * batch)
    scale, rows = kernels.HEAD_DIM ** -0.5, []
    for label, dtype in (("bf16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn)):
        case = (args[0], args[1].to(dtype), args[2].to(dtype), *args[3:])
        want = paged_attention_ref(case[0], case[1].to(torch.bfloat16), case[2].to(torch.bfloat16), *args[3:], scale)
        nbytes = 2 * sum(seq_lens) * kernels.NUM_KV_HEADS * kernels.HEAD_DIM * dtype.itemsize + 4 * args[0].numel()
        runs = [("engine", _engine, dict(c, keys_major=False)) for c in ENGINE_CONFIGS[label]]
        if "prefetch" in kinds:
            runs += [("prefetch", decode_prefetch, c) for c in VARIANT_CONFIGS]
        if "maxnreg" in kinds:  # FP8 dots take the keys-major tile (keys_major is implied)
            runs += [("maxnreg", _engine, dict(c) if "fp8_dots" in c else dict(c, keys_major=False))
                     for c in MAXNREG_CONFIGS[label]]
        # FP8 dots read V^T from a keys-contiguous value cache (their fastest form, attention_tile.value_tile_t)
        case_vt = (case[0], case[1], keys_contiguous(case[2]), *case[3:])
        for kind, fn, cfg in runs:
            case_of = case_vt if "fp8_dots" in cfg else case
            out = fn(*case_of, scale, **cfg)
            if once:  # under ncu: one launch of each
                continue
            err = float(((out.float() - want.float()).norm() / want.float().norm()).item())
            ms = kernels._time_ms(lambda: fn(*case_of, scale, **cfg))
            rows.append(dict(batch=batch, context=ctx, kv_cache_dtype=label, kernel=kind, config=cfg, us=ms * 1e3,
                             rel_err=err, pct_of_copy=100 * nbytes / (ms * 1e-3) / bandwidth))
            print(f"{label:9} b={batch:<4} ctx={ctx:<6} {kind:8} {cfg} {ms * 1e3:7.1f} us "
                  f"({rows[-1]['pct_of_copy']:.0f}% of copy) err {err:.1e}", flush=True)
        torch.cuda.synchronize()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.decode_prefetch",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=results_folder, default=RESULTS_DIR, help=FOLDER_HELP)
    p.add_argument("--once", action="store_true", help="one launch of each kernel, nothing timed (run under ncu)")
    p.add_argument("--cases", default="all", help="'all' or 'BATCHxCONTEXT,...'")
    p.add_argument("--kinds", default="prefetch", help="comma-separated: prefetch (the variant), maxnreg (the engine "
                   "kernel under a register cap); the engine kernel's own configs always run")
    args = p.parse_args(argv)
    require_cuda("decode_prefetch")
    cases = CASES if args.cases == "all" else [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    bandwidth = kernels.copy_bandwidth()
    kinds = tuple(args.kinds.split(","))
    rows = [r for batch, ctx in cases for r in _rows(batch, ctx, bandwidth, args.once, kinds)]
    if args.once:
        return 0
    env = environment()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{env['date'][:10]}-decode-{'-'.join(kinds)}.json"
    path.write_text(json.dumps({**env, "benchmark": "decode_prefetch", "copy_bandwidth_GBps": bandwidth / 1e9,
                                "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
