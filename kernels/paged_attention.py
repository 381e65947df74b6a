"""Varlen causal attention over a paged KV cache (decode and prefill), GQA, sliding window, soft cap, sinks.

Batch layout (vLLM's): the T query tokens of B sequences are flattened, sequence b owning rows
``query_start_loc[b]:query_start_loc[b+1]``. Its ``seq_lens[b]`` context tokens (cached prefix +
this step's tokens, already written with ``reshape_and_cache``) live in the blocks
``block_tables[b]``. Query token i of sequence b sits at position ``seq_lens[b] - q_len_b + i``
and sees keys at positions p <= its own, and p > pos - sliding_window when a window is set
(transformers' sliding-window mask). Scores are ``scale * q·k``, then
``soft_cap * tanh(scores / soft_cap)`` when soft_cap is set (Gemma 2); softmax in float32. Attention
sinks (GPT-OSS, `sinks` [Hq] float logits) join each head's softmax as one more score whose value vector
is zero: the probabilities of the real keys sum to less than one (transformers' `eager_attention_forward`
of gpt_oss).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fxrewrite.kernels import use_triton
from fxrewrite.kernels.attention_tile import check_paged_args, sinks_arg
from fxrewrite.kernels.batch_invariant import is_batch_invariant
from fxrewrite.kernels.paged_decode import paged_decode_triton
from fxrewrite.kernels.paged_prefill import paged_prefill_triton

__all__ = ["paged_attention", "paged_attention_ref", "causal_attention_batch_invariant", "BI_TILES"]

BI_TILES = {"block_m": 16, "block_n": 32, "num_warps": 4, "num_stages": 2}
"""Batch-invariant mode: the one attention kernel's launch (prefill and decode alike). Fixed tiles: a
query row's reduction walks keys in BLOCK_N tiles from position 0 and its dot products have one
instruction shape, whatever the batch, chunk or padding around it."""


SCORE_CHUNK_ELEMENTS = 1 << 22
"""The CPU reference attends a long prompt in query chunks of at most this many scores [Hq, rows, keys] (16 MiB
float32): an 8k-token prefill never builds [Hq, L, L] (2.4 GB per layer at 9 heads)."""


def _attend_one(q, k, v, first_pos, scale, sliding_window, soft_cap, sinks):
    """q [Lq, Hq, D] at positions first_pos.., k/v [Lk, Hkv, D] at positions 0.. -> [Lq, Hq, D] float32.

    Without a soft cap or sinks: torch's SDPA (its CPU flash kernel works in tiles), with its own causal mask
    for a fresh prompt, else an explicit mask per query chunk. With either: the masked float32 math per chunk. Chunks
    hold at most `SCORE_CHUNK_ELEMENTS` scores and see only the keys they can attend (causal, window)."""
    lq, hq, _ = q.shape
    k, v = k.float(), v.float()
    explicit = soft_cap is not None or sinks is not None
    if not explicit and sliding_window is None and first_pos == 0:
        return _sdpa(q, k, v, None, scale)
    rows = max(1, SCORE_CHUNK_ELEMENTS // (hq * max(k.shape[0], 1)))
    out = q.new_empty(q.shape, dtype=torch.float32)
    for start in range(0, lq, rows):
        stop = min(start + rows, lq)
        lo = 0 if sliding_window is None else max(0, first_pos + start - sliding_window + 1)
        hi = first_pos + stop  # keys past the chunk's last query are masked for all its rows
        q_pos = torch.arange(first_pos + start, first_pos + stop, device=q.device)
        k_pos = torch.arange(lo, hi, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        if not explicit:
            out[start:stop] = _sdpa(q[start:stop], k[lo:hi], v[lo:hi], visible, scale)
        else:
            out[start:stop] = _attend_rows(q[start:stop], k[lo:hi], v[lo:hi], visible, scale, soft_cap, sinks)
    return out


def _sdpa(q, k, v, visible, scale):
    """q [Lq, Hq, D], float32 k/v [Lk, Hkv, D], visible bool [Lq, Lk] (None: causal from key 0) -> [Lq, Hq, D]
    float32. 4-d inputs, so that the CPU flash kernel runs (3-d ones fall back to the [H, Lq, Lk] math)."""
    q, k, v = (t.transpose(0, 1)[None] for t in (q.float(), k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, is_causal=visible is None, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def _attend_rows(q, k, v, visible, scale, soft_cap, sinks):
    """q [Lq, Hq, D], float32 k/v [Lk, Hkv, D], visible bool [Lq, Lk] -> [Lq, Hq, D] float32: soft-capped
    scores, masked softmax with the sinks (GQA without copying k/v; a row that sees no key -> 0)."""
    num_kv_heads = k.shape[1]
    lq, hq, d = q.shape
    qg = q.float().view(lq, num_kv_heads, hq // num_kv_heads, d).permute(1, 2, 0, 3)
    kt = k.permute(1, 2, 0).unsqueeze(1)  # [Hkv, 1, D, Lk]
    scores = torch.matmul(qg, kt) * scale  # [Hkv, G, Lq, Lk]
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = _softmax_with_sinks(scores, sinks, (num_kv_heads, hq // num_kv_heads, 1, 1))
    out = torch.matmul(probs, v.permute(1, 0, 2).unsqueeze(1))  # [Hkv, G, Lq, D]
    return out.permute(2, 0, 1, 3).reshape(lq, hq, d)


def _softmax_with_sinks(scores, sinks, sink_shape):
    """Softmax over the last dim of float32 `scores` (-inf = masked), with each head's sink logit (`sinks` [Hq]
    viewed as `sink_shape`) as one more column that is dropped afterwards; a row of only -inf -> 0."""
    if sinks is None:
        return torch.softmax(scores, dim=-1).nan_to_num(0.0)
    sink = sinks.float().view(sink_shape).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


# Decode steps of up to this many gathered key elements run as one batched matmul in the reference.
_BATCHED_DECODE_ELEMENTS = 1 << 24


def _decode_ref_batched(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                        scale, sliding_window, soft_cap, sinks):
    """All sequences at once when each has at most one query token (keys padded to the longest)."""
    num_seqs, block_size = seq_lens.shape[0], key_cache.shape[1]
    lens = seq_lens.long()
    max_len = max(1, int(lens.max()))
    tables = block_tables[:num_seqs, : -(-max_len // block_size)].long().clamp(0, key_cache.shape[0] - 1)
    pos = torch.arange(max_len, device=query.device)
    visible = pos[None] < lens[:, None]
    if sliding_window is not None:
        visible &= pos[None] > lens[:, None] - 1 - sliding_window
    # Zero the padding so garbage (even NaN) in unused slots cannot leak through 0 * NaN.
    k = key_cache[tables].flatten(1, 2)[:, :max_len].float().masked_fill(~visible[..., None, None], 0.0)
    # contiguous: a keys-contiguous value cache (attention_tile.keys_contiguous) then gives these matmuls the same
    # operands, so the same roundings, as the row layout
    v = value_cache[tables].flatten(1, 2)[:, :max_len].contiguous().float().masked_fill(~visible[..., None, None], 0.0)
    starts = query_start_loc.long()
    has_q = starts[1:] > starts[:-1]
    rows = starts[:-1].clamp(max=max(query.shape[0] - 1, 0))
    num_kv_heads, (num_heads, head_dim) = k.shape[2], query.shape[1:]
    q = query[rows].float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", q, k) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = _softmax_with_sinks(scores, sinks, (1, num_kv_heads, num_heads // num_kv_heads, 1))
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)  # contiguous, as the op's fake
    o = torch.einsum("bhgl,blhd->bhgd", probs, v).reshape(num_seqs, num_heads, head_dim)
    out[rows[has_q]] = o[has_q].to(query.dtype)
    return out


def paged_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        max_query_len: int, max_seq_len: int, scale: float,
                        sliding_window: int | None = None, soft_cap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference: one masked float32 attention per sequence over its gathered blocks (a long prompt in
    query chunks of at most `SCORE_CHUNK_ELEMENTS` scores, so memory stays O(chunk * context)).

    query [T, Hq, D]; key_cache/value_cache [num_blocks, block_size, Hkv, D]; block_tables int
    [B, max_blocks]; seq_lens int [B]; query_start_loc int [B+1]; sinks None or [Hq] logits; returns [T, Hq, D] in
    query's dtype (rows of padding tokens outside every sequence, and rows that see no key, are 0).
    ``max_query_len``/``max_seq_len`` must bound the batch's (decode batches of at most
    2**24 gathered key elements run as one batched matmul). ValueError on bad shapes.
    """
    check_paged_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    sinks = None if sinks is None else sinks_arg(sinks, query)
    num_seqs, (_, block_size, num_kv_heads, head_dim) = seq_lens.shape[0], key_cache.shape
    # Batch-invariant mode: one sequence at a time (the batched decode pads to the longest context).
    if max_query_len == 1 and not is_batch_invariant() and num_seqs * max_seq_len * num_kv_heads * head_dim <= _BATCHED_DECODE_ELEMENTS:
        return _decode_ref_batched(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                   scale, sliding_window, soft_cap, sinks)
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)  # contiguous, as the op's fake
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len <= 0:
            continue
        if seq_len < q_len:
            raise ValueError(f"paged_attention: sequence {b} has seq_len {seq_len} < its {q_len} query tokens")
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[b, :num_blocks].long()
        k = key_cache[blocks].flatten(0, 1)[:seq_len]
        v = value_cache[blocks].flatten(0, 1)[:seq_len].contiguous()  # either value layout: the same roundings
        o = _attend_one(query[q_start:q_end], k, v, seq_len - q_len, scale, sliding_window, soft_cap, sinks)
        out[q_start:q_end] = o.to(query.dtype)
    return out


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    max_query_len: int, max_seq_len: int, scale: float,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    sinks: torch.Tensor | None = None, *, static_metadata: bool = False) -> torch.Tensor:
    """Paged attention; on CUDA the decode kernel (split-K) when ``max_query_len == 1``, else the
    varlen prefill kernel; on CPU :func:`paged_attention_ref`. Same contract as the reference; static_metadata:
    see :func:`~fxrewrite.kernels.paged_decode.paged_decode_triton`."""
    args = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
            max_query_len, max_seq_len, scale, sliding_window, soft_cap, sinks)
    if not use_triton(query):
        return paged_attention_ref(*args)
    if is_batch_invariant():  # one kernel, fixed tiles, no split-K (see BI_TILES)
        return paged_prefill_triton(*args, **BI_TILES)
    if max_query_len == 1:
        return paged_decode_triton(*args, static_metadata=static_metadata)
    return paged_prefill_triton(*args)


def _dense_causal_ref(q, k, v, scale, sliding_window, soft_cap):
    """q [B, Hq, L, D], k/v [B, Hkv, L, D] -> [B, L, Hq, D]: masked float32 attention (differentiable)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    pos = torch.arange(q.shape[2], device=q.device)
    visible = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        visible &= pos[None, :] > pos[:, None] - sliding_window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.matmul(probs, v).transpose(1, 2).to(q.dtype)


_TRAINER_PAGE = 16


class _CausalAttention(torch.autograd.Function):
    """Forward: `paged_attention` over the batch laid out as a paged cache (one block per row); backward:
    autograd through `_dense_causal_ref` (the same function, recomputed)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, sliding_window, soft_cap):
        batch, num_heads, length, head_dim = q.shape
        ctx.save_for_backward(q, k, v)
        ctx.args = (scale, sliding_window, soft_cap)
        query = q.transpose(1, 2).reshape(batch * length, num_heads, head_dim)
        # Pages of the engine's default 16 slots: the kernel's integer arguments (block size, strides) fall
        # in the same Triton specialisation classes as the engine's launches.
        pages = -(-length // _TRAINER_PAGE)
        pad = pages * _TRAINER_PAGE - length
        key_cache, value_cache = (F.pad(t.transpose(1, 2), (0, 0, 0, 0, 0, pad)).reshape(
            batch * pages, _TRAINER_PAGE, t.shape[1], head_dim) for t in (k, v))
        idx = dict(dtype=torch.int32, device=q.device)
        block_tables = torch.arange(batch * pages, **idx).view(batch, pages)
        seq_lens = torch.full((batch,), length, **idx)
        query_start_loc = torch.arange(0, batch * length + 1, length, **idx)
        out = paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                              length, length, scale, sliding_window, soft_cap)
        return out.view(batch, length, num_heads, head_dim)

    @staticmethod
    @once_differentiable  # the recomputation runs on detached inputs: create_graph=True raises, never a silent zero
    def backward(ctx, grad_out):
        q, k, v = (t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = _dense_causal_ref(q, k, v, *ctx.args)
            wanted = [t for t in (q, k, v) if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad_out) if wanted else ())
        return tuple(next(grads) if t.requires_grad else None for t in (q, k, v)) + (None, None, None)


def causal_attention_batch_invariant(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                                     sliding_window: int | None = None,
                                     soft_cap: float | None = None) -> torch.Tensor:
    """Causal attention of whole right-padded rows through the engine's own paged kernel, for a trainer's
    recomputation: query [B, Hq, L, D], key/value [B, Hkv, L, D] (transformers' layout) -> [B, L, Hq, D].

    Each row is one sequence of L tokens (padding sits after the real tokens, so causality alone keeps
    it out of their attention). Inside `batch_invariant_mode()` this is the kernel and launch
    (`BI_TILES`) the engine's prefill and decode steps run, so a query's output is bitwise the engine's.
    Differentiable: the backward recomputes `_dense_causal_ref` (float32 math attention) under autograd.
    """
    return _CausalAttention.apply(query, key, value, float(scale), sliding_window, soft_cap)
