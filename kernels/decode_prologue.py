"""Qwen3's attention prologue inside the paged decode kernel: the step's raw q, k and v go in, and each decode
program normalises and rotates its own query heads, while the one program whose keys include the new token also
normalises and rotates that token's key and writes it and its value to the paged cache before it walks its keys.

The same computation as :func:`fxrewrite.kernels.qk_norm_rope_cache.qk_norm_rope_cache` followed by the decode
attention (the reference is that pair), with one launch a layer fewer at decode. Measured slower in its first form
(H100, batch 1, native: Qwen3-30B-A3B 339.1 -> 327.6 tokens/s, Qwen3-4B 306.4 -> 301.3,
2026-12-07-*-latency-decode-prologue-{off,on}-h100-fifty-sixth.json): the decode program's key loads wait for the
prologue, where the separate kernel finished before the decode kernel's PDL wait. The form here (the writer reads
the new key and value with the query; the static loads before the wait) is not measured yet, so
``FXREWRITE_DECODE_PROLOGUE`` stays "off" by default, a measurement switch.

Every split program of a (sequence, kv head) recomputes the G query heads it holds (a [G, D] tile, a few hundred
flops); the new key is written by exactly one program, the split whose keys [start, end)
end at the sequence's length, and read back by that program only, after a CTA barrier (``bar.sync`` orders a block's
global writes before its later reads). The query tile is built feature by feature: each feature loads its rotary
partner (neox halves or GPT-J pairs) next to itself, so the tile comes out in the head's natural order, the layout
the attention dot takes.
"""

from __future__ import annotations

import dataclasses

import torch

from fxrewrite.kernels import on_off_switch
from fxrewrite.kernels.qk_norm_rope import check_qk_norm_rope_args
from fxrewrite.kernels.qk_norm_rope_cache import cacheable, qk_norm_rope_cache
from fxrewrite.kernels.reshape_and_cache import cache_clamp, check_cache_args
from fxrewrite.kernels.triton_utils import tl, triton

__all__ = ["DecodePrologue", "decode_prologue_enabled", "apply_prologue", "prologue_fusable", "prologue_launch_args"]


def decode_prologue_enabled() -> bool:
    """``FXREWRITE_DECODE_PROLOGUE``: "on" folds the q/k norm + rotary + cache write into the decode kernel (native
    Qwen3 models, eager and CUDA-graph decode), "off" (default) keeps the separate kernel. ValueError naming another
    value."""
    return on_off_switch("FXREWRITE_DECODE_PROLOGUE", "off")


@dataclasses.dataclass(frozen=True)
class DecodePrologue:
    """What the attention's prologue needs besides the raw query: positions int64 [T]; q_weight / k_weight [D] (the
    per-head RMSNorm weights, transformers' Qwen3 q_norm / k_norm) with their `eps`; cos_sin_cache [max_position,
    rotary_dim] float32 (cos then sin); is_neox_style; and, once the attention layer fills them in (`with_kv`), the
    step's raw key / value [T, Hkv, D] and its slot_mapping int64 [>= T] (negative slots are not written)."""

    positions: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    cos_sin_cache: torch.Tensor
    is_neox_style: bool
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None

    def with_kv(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> DecodePrologue:
        return dataclasses.replace(self, key=key, value=value, slot_mapping=slot_mapping)


def apply_prologue(query: torch.Tensor, prologue: DecodePrologue, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, static_metadata: bool = False) -> torch.Tensor:
    """The prologue as its own launch (:func:`qk_norm_rope_cache`; the reference on a CPU): writes the step's key
    and value to the caches and returns the normalised, rotated query [T, Hq, D] (in place under Triton)."""
    num_tokens, _, head_size = query.shape
    q, _ = qk_norm_rope_cache(prologue.positions, query.reshape(num_tokens, -1), prologue.key.reshape(num_tokens, -1),
                              prologue.value.reshape(num_tokens, -1), prologue.q_weight, prologue.k_weight,
                              prologue.eps, head_size, prologue.cos_sin_cache, prologue.is_neox_style, key_cache,
                              value_cache, prologue.slot_mapping, static_metadata=static_metadata)
    return q.view(query.shape)


def prologue_fusable(prologue: DecodePrologue, key_cache: torch.Tensor) -> bool:
    """Whether the decode kernel can run `prologue` itself: a cache in the key's dtype or FP8 (a cache of another
    wider dtype takes the unfused pair's two roundings, :func:`qk_norm_rope_cache`)."""
    return key_cache.dtype == prologue.key.dtype or cache_clamp(key_cache.dtype) > 0


def prologue_launch_args(query: torch.Tensor, prologue: DecodePrologue | None, key_cache: torch.Tensor,
                         value_cache: torch.Tensor) -> tuple[tuple, dict]:
    """The decode kernel's prologue arguments (pointers, eps, strides) and constexprs for `prologue`, or inert
    placeholders (PROLOGUE=False) for None. ValueError on shapes the prologue cannot take."""
    if prologue is None:
        return (query,) * 7 + (0.0, 0, 0, 0, 0, 0), dict(PROLOGUE=False, ROT_HALF=1, IS_NEOX=True, CLAMP=0.0)
    num_tokens, _, head_size = query.shape
    key, value = prologue.key, prologue.value
    if not prologue_fusable(prologue, key_cache):
        raise ValueError(f"decode prologue: a {key_cache.dtype} cache under a {key.dtype} key; expected the key's "
                         "dtype or an FP8 cache (run apply_prologue first)")
    check_cache_args(key, value, key_cache, value_cache, prologue.slot_mapping)
    check_qk_norm_rope_args(query, key, prologue.q_weight, prologue.k_weight, head_size, prologue.cos_sin_cache)
    if prologue.positions.shape != (num_tokens,) or key.dim() != 3 or value.stride(-1) != 1:
        raise ValueError(f"decode prologue: positions {tuple(prologue.positions.shape)}, key {tuple(key.shape)}, "
                         f"value strides {value.stride()}; expected [{num_tokens}], [T, Hkv, D], a contiguous head dim")
    cos_sin = prologue.cos_sin_cache
    args = (prologue.positions, key, value, prologue.q_weight, prologue.k_weight, cos_sin, prologue.slot_mapping,
            float(prologue.eps), key.stride(0), key.stride(1), value.stride(0), value.stride(1), cos_sin.stride(0))
    return args, dict(PROLOGUE=True, ROT_HALF=cos_sin.shape[-1] // 2, IS_NEOX=prologue.is_neox_style,
                      CLAMP=cache_clamp(key_cache.dtype))


@triton.jit
def _feature_lanes(HEAD_DIM: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per feature d of a head [BLOCK_D]: (d, d < HEAD_DIM, whether rotated, whether the first of its rotary pair, its
    pair partner (itself when not rotated), its cos / sin lane) for neox halves or GPT-J pairs."""
    d = tl.arange(0, BLOCK_D)
    rot = d < 2 * HALF
    if IS_NEOX:
        first = d < HALF
        partner = tl.where(first, d + HALF, d - HALF)
        lane = tl.where(first, d, d - HALF)
    else:
        first = d % 2 == 0
        partner = tl.where(first, d + 1, d - 1)
        lane = d // 2
    return d, d < HEAD_DIM, rot, first, tl.where(rot, partner, d), tl.where(rot, lane, 0)


@triton.jit
def prologue_constants(pos_ptr, slot_ptr, tok, active, qw_ptr, kw_ptr, cs_ptr, cs_s0, HEAD_DIM: tl.constexpr,
                       HALF: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_D: tl.constexpr):
    """What of the prologue no earlier kernel of the step writes, so that under PDL with static metadata it is read
    during the previous kernel's tail: (slot, cos, sin, q weight, q weight at the partners, k weight, k weight at the
    partners), float32 rows [1, BLOCK_D] but the slot (int64; -1 for an inactive program)."""
    d, d_mask, rot, first, partner, lane = _feature_lanes(HEAD_DIM, HALF, IS_NEOX, BLOCK_D)
    pos = tl.load(pos_ptr + tok, mask=active, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + tok, mask=active, other=-1).to(tl.int64)
    cos = tl.load(cs_ptr + pos * cs_s0 + lane, mask=rot, other=1.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * cs_s0 + HALF + lane, mask=rot, other=0.0).to(tl.float32)[None, :]
    qw = tl.load(qw_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    qwp = tl.load(qw_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    kw = tl.load(kw_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    kwp = tl.load(kw_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    return slot, cos, sin, qw, qwp, kw, kwp


@triton.jit
def load_head_rows(rows, rmask, num_features, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """Heads `rows` [R, 1] (pointers to each head's first feature; `rmask` [R, 1]: the rows to read) as `norm_rope`
    takes them: each feature [R, BLOCK_D] and its rotary partner, in the rows' dtype; features from `num_features`
    (HEAD_DIM, or 0 to read nothing) on are 0."""
    d, d_mask, rot, first, partner, lane = _feature_lanes(HEAD_DIM, HALF, IS_NEOX, BLOCK_D)
    mask = rmask & (d < num_features)[None, :]
    return tl.load(rows + d[None, :], mask=mask, other=0.0), tl.load(rows + partner[None, :], mask=mask, other=0.0)


@triton.jit
def norm_rope(x, xp, w, wp, cos, sin, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """Heads `x` [R, BLOCK_D] (`xp`: at each feature's partner; `load_head_rows`) normalised with the weight `w`
    (`wp`: at the partners) and rotated by `cos` / `sin` (`prologue_constants`): [R, BLOCK_D] in x's dtype, features
    in their order. The roundings of :func:`~fxrewrite.kernels.qk_norm_rope.norm_rope_tile` (Llama's RMSNorm: x * rstd
    rounded, times the weight, rounded; the rotation in float32)."""
    d, d_mask, rot, first, partner, lane = _feature_lanes(HEAD_DIM, HALF, IS_NEOX, BLOCK_D)
    dtype = x.dtype
    x, xp = x.to(tl.float32), xp.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
    y = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
    yp = ((xp * rstd).to(dtype).to(tl.float32) * wp).to(dtype).to(tl.float32)
    out = tl.where(first[None, :], y * cos - yp * sin, y * cos + yp * sin)
    return tl.where(rot[None, :], out, y).to(dtype)


@triton.jit
def prologue_tile(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, tok, kvh, heads, g_mask, owner, slot, cos, sin, qw, qwp, kw,
                  kwp, eps, q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, vc_s3,
                  block_size, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr, CLAMP: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """A decode program's prologue: the query heads `heads` [BLOCK_G] (mask `g_mask`) of token `tok`, normalised and
    rotated ([BLOCK_G, BLOCK_D], returned); when `owner` (its keys end with the new one) and the token's `slot` is
    mapped, the new key and value of kv head `kvh` written to the cache as the unfused pair writes them
    (`cacheable`), then a CTA barrier, so that the program's key loads see them. The key and value are read with the
    query (masked off elsewhere), so the owner waits one memory round trip for all three."""
    tok64 = tok.to(tl.int64)
    writes = owner & (slot >= 0)
    # features of the new key and value this program reads: all of them in the writer, none elsewhere (a length, not
    # a boolean mask: the interpreter widens a scalar condition and'ed into a mask to integers)
    kv_features = tl.where(writes, HEAD_DIM, 0)
    xq, xqp = load_head_rows(q_ptr + tok64 * q_s0 + heads[:, None] * q_s1, g_mask[:, None], HEAD_DIM, HEAD_DIM, HALF,
                             IS_NEOX, BLOCK_D)
    k_rows = k_ptr + tok64 * k_s0 + kvh * k_s1 + tl.zeros([1, 1], dtype=tl.int64)
    xk, xkp = load_head_rows(k_rows, tl.full([1, 1], True, tl.int1), kv_features, HEAD_DIM, HALF, IS_NEOX, BLOCK_D)
    d = tl.arange(0, BLOCK_D)[None, :]
    d_mask = d < HEAD_DIM
    value = tl.load(v_ptr + tok64 * v_s0 + kvh * v_s1 + d, mask=d < kv_features)
    q = norm_rope(xq, xqp, qw, qwp, cos, sin, eps, HEAD_DIM, HALF, IS_NEOX, BLOCK_D)
    if writes:
        key = norm_rope(xk, xkp, kw, kwp, cos, sin, eps, HEAD_DIM, HALF, IS_NEOX, BLOCK_D)
        k_dtype = k_ptr.dtype.element_ty
        blk = slot // block_size
        off = slot % block_size
        tl.store(kc_ptr + blk * kc_s0 + off * kc_s1 + kvh * kc_s2 + d,
                 cacheable(key, k_dtype, CLAMP).to(kc_ptr.dtype.element_ty), mask=d_mask)
        tl.store(vc_ptr + blk * vc_s0 + off * vc_s1 + kvh * vc_s2 + d * vc_s3,
                 cacheable(value, k_dtype, CLAMP).to(vc_ptr.dtype.element_ty), mask=d_mask)
        tl.debug_barrier()
    return q
