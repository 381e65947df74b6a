"""Qwen3's attention prologue inside the paged decode kernel: per-head RMSNorm of q and k, rotary, and the step's
key / value written to the cache, by the decode programs themselves (``FXREWRITE_DECODE_QK``).

Unfused, a decode layer runs q/k norm + rotary + cache write (`fxrewrite.kernels.qk_norm_rope_cache`) and then the
paged decode kernel, which waits for it: under PDL every kernel boundary is a grid-completion wait plus the next
kernel's first dependent loads. Here each decode program (sequence, kv head, split) normalises and rotates the G
query heads it attends for straight from the QKV projection's output, in registers, and the program whose
partition holds the sequence's newest key (its last split) normalises and rotates that key, writes it and the
value to their cache slot, and waits on a block barrier before its tile loop reads the slot back. The values are
the unfused pair's, bitwise: the same `norm_rope_tile` math and roundings.

Where it applies (`fusable`, else the caller keeps the pair): decode steps (one query token per sequence), a
cache of the query's dtype, full rotary (rotary dim = head dim, a power of two), no batch-invariant mode, the
heads-major decode tile (no FP8 dots, no keys-contiguous value cache).

Entry point and reference: `fxrewrite.kernels.paged_attention.paged_attention_qk_norm_rope`, whose unfused path
(`qk_norm_rope_cache`, then `paged_attention`; their torch references on a CPU) is what the fused kernel must equal.
"""

from __future__ import annotations

import torch

from fxrewrite.kernels import on_off_switch
from fxrewrite.kernels.qk_norm_rope import norm_rope_tile, norm_weights, store_heads
from fxrewrite.kernels.rotary import pair_offsets
from fxrewrite.kernels.triton_utils import tl, triton

__all__ = ["enabled", "fusable", "qk_launch_args", "launch_parts", "token_rotary", "decode_query", "write_new_kv"]


def enabled() -> bool:
    """``FXREWRITE_DECODE_QK``: "off" (default until it is measured on a GPU) or "on"; ValueError naming any other
    value."""
    return on_off_switch("FXREWRITE_DECODE_QK", "off")


def fusable(query: torch.Tensor, key_cache: torch.Tensor, head_size: int, cos_sin_cache: torch.Tensor) -> bool:
    """Whether the fused prologue applies (see the module docstring; the caller checks the step and the tile)."""
    return (key_cache.dtype == query.dtype and cos_sin_cache.shape[-1] == head_size
            and head_size >= 16 and head_size & (head_size - 1) == 0)


def qk_launch_args(positions, key, value, q_weight, k_weight, eps, cos_sin_cache, is_neox_style, slot_mapping,
                   head_size: int) -> tuple[list, dict]:
    """The decode kernel's extra arguments for the fused prologue: (positional, constexpr). key / value
    [T, Hkv*D] (views of the QKV output; each head's D features contiguous)."""
    num_tokens = positions.numel()
    k, v = key.view(num_tokens, -1, head_size), value.view(num_tokens, -1, head_size)
    return ([k, v, q_weight, k_weight, cos_sin_cache, positions, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
             v.stride(1), cos_sin_cache.stride(0), float(eps)],
            dict(QK_ROPE=True, IS_NEOX=is_neox_style, HALF=head_size // 2))


def launch_parts(qk_rope, query: torch.Tensor, keys_major: bool, block_d: int) -> tuple[list, dict]:
    """The decode launch's prologue arguments for `paged_decode_triton`'s ``qk_rope``: None (placeholders, no
    prologue) or `qk_launch_args`' pair, ``query`` then being the un-normalised q [T, Hq, D]; the kernel normalises
    and rotates q and the step's key and writes key and value to the cache (the caller checked `fusable`). ValueError
    for a tile the prologue cannot fill (keys-major, or a head dim that is not its padded width)."""
    if qk_rope is None:
        return [query] * 7 + [0] * 5 + [0.0], {}
    if keys_major or block_d != query.shape[-1]:
        raise ValueError(f"paged_decode_triton: q/k norm + rotary needs the heads-major tile and a power-of-two head "
                         f"dim; got keys_major={keys_major}, head dim {query.shape[-1]}")
    return qk_rope


@triton.jit
def token_rotary(pos_ptr, cs_ptr, cs_s0, qw_ptr, kw_ptr, tok, active, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """cos, sin [1, HALF] of token `tok`'s position (row 0 for a program without work: an empty sequence's `tok` is
    past the step's tokens), the pair offsets and both norms' weights (float32)."""
    i = tl.arange(0, HALF)
    imask = i < HALF
    pos = tl.load(pos_ptr + tok, mask=active, other=0).to(tl.int64)
    cos = tl.load(cs_ptr + pos * cs_s0 + i).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * cs_s0 + HALF + i).to(tl.float32)[None, :]
    off1, off2 = pair_offsets(i, HALF, IS_NEOX)
    offp = 2 * HALF + tl.arange(0, 1)  # no pass-through features (full rotary)
    pmask = offp < 0
    qw = norm_weights(qw_ptr, off1, off2, imask, offp, pmask)
    kw = norm_weights(kw_ptr, off1, off2, imask, offp, pmask)
    return cos, sin, off1, off2, imask, offp, pmask, qw, kw


@triton.jit
def decode_query(q_rows, num_heads, qw, cos, sin, eps, off1, off2, imask, offp, pmask, HALF: tl.constexpr,
                 BLOCK_G: tl.constexpr, IS_NEOX: tl.constexpr):
    """The [BLOCK_G, 2 * HALF] query tile (q's dtype) of `num_heads` heads at `q_rows` [BLOCK_G, 1], normalised and
    rotated as `qk_norm_rope_cache` writes them (rows past num_heads are zero)."""
    o1, o2, _, _, _ = norm_rope_tile(q_rows, num_heads, qw[0], qw[1], qw[2], cos, sin, eps, off1, off2, imask, offp,
                                     pmask, 2 * HALF, BLOCK_G)
    pairs = tl.join(o1, o2)  # [BLOCK_G, HALF, 2]: feature (i, i + HALF) for neox, (2i, 2i + 1) for GPT-J
    if IS_NEOX:
        pairs = tl.permute(pairs, (0, 2, 1))
    return tl.reshape(pairs, (BLOCK_G, 2 * HALF))


@triton.jit
def write_new_kv(owner, k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, tok, kvh, k_s0, k_s1, v_s0, v_s1, kc_s0, kc_s1, kc_s2,
                 vc_s0, vc_s1, vc_s2, vc_s3, block_size, kw, cos, sin, eps, off1, off2, imask, offp, pmask,
                 HALF: tl.constexpr):
    """In the program whose partition holds the sequence's newest key (`owner`): normalise and rotate kv head `kvh`
    of token `tok`'s key and write it and the value to the token's cache slot (a negative slot: nothing written),
    then a block barrier, so that the program's tile loads that follow see them."""
    if owner:
        _write_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, tok, kvh, k_s0, k_s1, v_s0, v_s1, kc_s0, kc_s1, kc_s2, vc_s0,
                  vc_s1, vc_s2, vc_s3, block_size, kw, cos, sin, eps, off1, off2, imask, offp, pmask, HALF)
        tl.debug_barrier()


@triton.jit
def _write_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, tok, kvh, k_s0, k_s1, v_s0, v_s1, kc_s0, kc_s1, kc_s2, vc_s0,
              vc_s1, vc_s2, vc_s3, block_size, kw, cos, sin, eps, off1, off2, imask, offp, pmask, HALF: tl.constexpr):
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        one = tl.arange(0, 1)[:, None]
        k_rows = k_ptr + tok.to(tl.int64) * k_s0 + kvh * k_s1 + one
        o1, o2, op, m1, mp = norm_rope_tile(k_rows, 1, kw[0], kw[1], kw[2], cos, sin, eps, off1, off2, imask, offp,
                                            pmask, 2 * HALF, 1)
        blk = slot // block_size
        off = slot % block_size
        store_heads(kc_ptr + blk * kc_s0 + off * kc_s1 + kvh * kc_s2 + one, off1, off2, offp, o1, o2, op, m1, mp)
        d = tl.arange(0, 2 * HALF)
        v = tl.load(v_ptr + tok.to(tl.int64) * v_s0 + kvh * v_s1 + d)
        tl.store(vc_ptr + blk * vc_s0 + off * vc_s1 + kvh * vc_s2 + d * vc_s3, v.to(vc_ptr.dtype.element_ty))
