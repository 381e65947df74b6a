"""Varlen causal prefill over a paged KV cache (chunked prefill, prefix-cache hits, mixed batches).

Grid (query tile, query head, sequence): a tile of BLOCK_M query tokens of one head reads the
keys of its kv head (head // G, GQA) through the block table, cached prefix included, because
the query tokens sit at the end of their sequence (position ``seq_len - q_len + i``). Keys past
the tile's last position are never loaded; with a sliding window neither are keys before the
first one. Online softmax in float32 (FlashAttention-2); attention sinks start it from the head's sink logit
(running max = sink, sum = 1, output 0). Semantics: :mod:`fxrewrite.kernels.paged_attention`.
"""

from __future__ import annotations

import torch

from fxrewrite.kernels.attention_tile import (attention_tile, check_last_dim_contiguous, check_paged_args, dot_dtype,
                                              fp16_dots, sinks_arg, value_run, widen_asm)
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["paged_prefill_triton"]


# The block-table width changes every step, and seq_lens / query_start_loc are slices of the engine's packed
# step buffer whose 16-byte alignment does too: no specialisation on either (one binary for every step).
@triton.jit(do_not_specialize=["bt_s0"], do_not_specialize_on_alignment=["seq_lens_ptr", "qsl_ptr"])
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, sinks_ptr,
                    scale, soft_cap, sliding_window, block_size,
                    q_s0, q_s1, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, vc_s3, bt_s0, o_s0, o_s1,
                    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, FP16_DOTS: tl.constexpr,
                    WIDEN_ASM: tl.constexpr, V_RUN: tl.constexpr):
    m_blk = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if m_blk * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx_len = seq_len - q_len
        kvh = head // G
        offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        md_mask = (offs_m[:, None] < q_len) & d_mask[None, :]
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * q_s0 + head * q_s1 + offs_d[None, :], mask=md_mask, other=0.0)
        q = dot_dtype(q, FP16_DOTS)
        q_pos = ctx_len + offs_m
        hi = tl.minimum(seq_len, ctx_len + (m_blk + 1) * BLOCK_M)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_SINKS:  # the sink logit (log2 domain) with a zero value vector
            m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(sinks_ptr + head) * 1.4426950408889634
            l_i += 1.0
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        bt_row = bt_ptr + seq.to(tl.int64) * bt_s0
        if HAS_WINDOW:
            lo = tl.maximum(0, ctx_len + m_blk * BLOCK_M - sliding_window + 1)
            if V_RUN > 1:  # tiles of a keys-contiguous value cache start at a run; the window mask hides the rest
                lo -= lo % V_RUN
            for n0 in range(lo, hi, BLOCK_N):
                m_i, l_i, acc = attention_tile(q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, n0, hi, q_pos, kvh, scale,
                                               soft_cap, sliding_window, block_size, kc_s0, kc_s1, kc_s2,
                                               vc_s0, vc_s1, vc_s2, vc_s3, offs_d, d_mask, BLOCK_N, True,
                                               HAS_SOFTCAP, True, DOT_PRECISION, WIDEN_ASM, V_RUN)
        else:
            # Keys at or before the tile's first query position are visible to every row: no mask.
            mid = tl.minimum((ctx_len + m_blk * BLOCK_M + 1) // BLOCK_N * BLOCK_N, hi)
            for n0 in range(0, mid, BLOCK_N):
                m_i, l_i, acc = attention_tile(q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, n0, hi, q_pos, kvh, scale,
                                               soft_cap, sliding_window, block_size, kc_s0, kc_s1, kc_s2,
                                               vc_s0, vc_s1, vc_s2, vc_s3, offs_d, d_mask, BLOCK_N, False,
                                               HAS_SOFTCAP, False, DOT_PRECISION, WIDEN_ASM, V_RUN)
            for n0 in range(mid, hi, BLOCK_N):
                m_i, l_i, acc = attention_tile(q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, n0, hi, q_pos, kvh, scale,
                                               soft_cap, sliding_window, block_size, kc_s0, kc_s1, kc_s2,
                                               vc_s0, vc_s1, vc_s2, vc_s3, offs_d, d_mask, BLOCK_N, True,
                                               HAS_SOFTCAP, False, DOT_PRECISION, WIDEN_ASM, V_RUN)
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * o_s0 + head * o_s1 + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=md_mask)


def paged_prefill_triton(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                         max_query_len, max_seq_len, scale, sliding_window=None, soft_cap=None, sinks=None,
                         *, block_m: int = 64, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                         fp8_dots: str = "float16"):
    """Prefill launch for any mix of query lengths (``max_query_len`` must bound them: it sizes
    the grid). Keyword-only knobs are for tests and the benchmark (``fp8_dots``: see
    :mod:`fxrewrite.kernels.attention_tile`). Same contract as the reference."""
    check_paged_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    check_last_dim_contiguous(query, key_cache)
    v_run = value_run(value_cache, block_n)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], key_cache.shape[2]
    # contiguous whatever query's strides (e.g. a transposed view): the layout fxrewrite::paged_attend's fake promises
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0 or num_tokens == 0 or max_query_len <= 0:
        return out
    grid = (triton.cdiv(max_query_len, block_m), num_heads, num_seqs)
    launch(_prefill_kernel, grid, query.device)(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, sinks_arg(sinks, out),
        float(scale), float(soft_cap or 0.0), int(sliding_window or 0), key_cache.shape[1],
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), value_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        G=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, next_power_of_2(head_dim)), HAS_SOFTCAP=soft_cap is not None,
        HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", FP16_DOTS=fp16_dots(query, key_cache, fp8_dots),
        WIDEN_ASM=widen_asm(query, key_cache, fp8_dots), V_RUN=v_run, num_warps=num_warps, num_stages=num_stages)
    return out
