"""Qwen3's attention prologue and the paged KV-cache write in one launch: per-head RMSNorm of q and k,
rotary, then this step's rotated keys and its values go to their cache slots (vLLM ``reshape_and_cache``).

The same computation as :func:`fxrewrite.kernels.qk_norm_rope.qk_norm_rope` followed by
:func:`fxrewrite.kernels.reshape_and_cache.reshape_and_cache` on the rotated key; fused, a decode
step has one launch per layer fewer, and the rotated key is written to the cache from registers
instead of being read back. An FP8 cache gets the key rounded to its dtype, then clamped and cast, as the pair
writes it (until 2026-12-03 it fell back to the pair: in a Qwen3-4B decode step at batch 200 on an H200 the pair
took 184 us where the fused kernel took 145 over a bf16 cache, 2026-12-03-qwen3-4b-native-*b200-decode-profile-
twentysixth.json; the fused FP8 form is not timed yet). Cache layout and slot semantics:
:mod:`fxrewrite.kernels.reshape_and_cache`.
"""

from __future__ import annotations

import torch

from fxrewrite.kernels import use_triton
from fxrewrite.kernels.pdl import early_loads, gdc_prologue, pdl_enabled
from fxrewrite.kernels.qk_norm_rope import (check_qk_norm_rope_args, norm_rope_tile, norm_weights, qk_norm_rope_ref,
                                            qk_norm_rope_triton, store_heads)
from fxrewrite.kernels.reshape_and_cache import cache_clamp, check_cache_args, reshape_and_cache, reshape_and_cache_ref
from fxrewrite.kernels.rotary import pair_offsets, token_cos_sin
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["qk_norm_rope_cache", "qk_norm_rope_cache_ref", "qk_norm_rope_cache_triton"]


def qk_norm_rope_cache_ref(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, head_size: int,
                           cos_sin_cache: torch.Tensor, is_neox_style: bool, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: returns new ``(query, key)`` (normalised, rotated) and writes key / value into the
    caches at ``slot_mapping`` (negative slots skipped).

    positions int64 [T]; query [T, Hq*D]; key / value [T, Hkv*D]; q_weight / k_weight [D];
    cos_sin_cache [max_position, rotary_dim] float32; key_cache / value_cache [num_blocks, block_size, Hkv, D];
    slot_mapping int [>= T]. ValueError on inconsistent shapes."""
    query, key = qk_norm_rope_ref(positions, query, key, q_weight, k_weight, eps, head_size, cos_sin_cache,
                                  is_neox_style)
    num_tokens = positions.numel()
    reshape_and_cache_ref(key.reshape(num_tokens, -1, head_size), value.reshape(num_tokens, -1, head_size),
                          key_cache, value_cache, slot_mapping)
    return query, key


def qk_norm_rope_cache(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, head_size: int,
                       cos_sin_cache: torch.Tensor, is_neox_style: bool, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       static_metadata: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton on CUDA (q and k in place; returns them), else :func:`qk_norm_rope_cache_ref`: use the results.
    static_metadata: see :func:`qk_norm_rope_cache_triton`."""
    if use_triton(query):
        return qk_norm_rope_cache_triton(positions, query, key, value, q_weight, k_weight, eps, head_size,
                                         cos_sin_cache, is_neox_style, key_cache, value_cache, slot_mapping,
                                         static_metadata)
    return qk_norm_rope_cache_ref(positions, query, key, value, q_weight, k_weight, eps, head_size, cos_sin_cache,
                                  is_neox_style, key_cache, value_cache, slot_mapping)


# positions / slot_mapping are slices of the engine's packed step buffers, whose 16-byte alignment
# changes from step to step: not specialised on (one binary for every step)
@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _qk_norm_rope_cache_kernel(pos_ptr, q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cache_ptr, kc_ptr, vc_ptr, slot_ptr,
                               q_tok_stride, q_head_stride, k_tok_stride, k_head_stride, v_tok_stride,
                               v_head_stride, cache_stride, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, vc_s3, block_size,
                               num_q_heads, num_k_heads, eps, CLAMP: tl.constexpr,
                               HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                               PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_HQ: tl.constexpr,
                               BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, IS_NEOX: tl.constexpr,
                               PDL: tl.constexpr, EARLY: tl.constexpr):
    if not EARLY:
        gdc_prologue(PDL)
    # positions, slot mapping, cos / sin and the norm weights: with EARLY (kernels/pdl.py early_loads) read while
    # the previous kernel (the QKV projection) finishes
    tok, i, imask, cos, sin = token_cos_sin(pos_ptr, cache_ptr, cache_stride, HALF, BLOCK_HALF)
    off1, off2 = pair_offsets(i, HALF, IS_NEOX)
    j = tl.arange(0, BLOCK_PASS)
    offp = 2 * HALF + j  # features past rotary_dim: normalised, not rotated
    pmask = j < PASS
    qw1, qw2, qwp = norm_weights(qw_ptr, off1, off2, imask, offp, pmask)
    kw1, kw2, kwp = norm_weights(kw_ptr, off1, off2, imask, offp, pmask)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if EARLY:
        gdc_prologue(PDL)
    q_rows = q_ptr + tok * q_tok_stride + tl.arange(0, BLOCK_HQ)[:, None] * q_head_stride
    o1, o2, op, m1, mp = norm_rope_tile(q_rows, num_q_heads, qw1, qw2, qwp, cos, sin, eps, off1, off2, imask, offp,
                                        pmask, HEAD_DIM, BLOCK_HQ)
    store_heads(q_rows, off1, off2, offp, o1, o2, op, m1, mp)
    heads = tl.arange(0, BLOCK_HK)[:, None]
    k_rows = k_ptr + tok * k_tok_stride + heads * k_head_stride
    o1, o2, op, m1, mp = norm_rope_tile(k_rows, num_k_heads, kw1, kw2, kwp, cos, sin, eps, off1, off2, imask, offp,
                                        pmask, HEAD_DIM, BLOCK_HK)
    store_heads(k_rows, off1, off2, offp, o1, o2, op, m1, mp)
    if slot >= 0:  # padding rows and already-cached tokens have slot -1
        blk = slot // block_size
        off = slot % block_size
        k_dtype = k_ptr.dtype.element_ty
        store_heads(kc_ptr + blk * kc_s0 + off * kc_s1 + heads * kc_s2, off1, off2, offp, _cacheable(o1, k_dtype, CLAMP),
                    _cacheable(o2, k_dtype, CLAMP), _cacheable(op, k_dtype, CLAMP), m1, mp)
        d = tl.arange(0, BLOCK_D)[None, :]
        vmask = (heads < num_k_heads) & (d < HEAD_DIM)
        v = _cacheable(tl.load(v_ptr + tok * v_tok_stride + heads * v_head_stride + d, mask=vmask), k_dtype, CLAMP)
        tl.store(vc_ptr + blk * vc_s0 + off * vc_s1 + heads * vc_s2 + d * vc_s3, v.to(vc_ptr.dtype.element_ty),
                 mask=vmask)


@triton.jit
def _cacheable(x, DTYPE: tl.constexpr, CLAMP: tl.constexpr):
    """`x` as the unfused pair hands it to the cache: for an FP8 cache (CLAMP, its finite range, > 0) rounded to the
    key's DTYPE as qk_norm_rope stores it, then clamped in float32 as reshape_and_cache does; else as is."""
    if CLAMP > 0:
        x = tl.minimum(tl.maximum(x.to(DTYPE).to(tl.float32), -CLAMP), CLAMP)
    return x


def qk_norm_rope_cache_triton(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, head_size: int,
                              cos_sin_cache: torch.Tensor, is_neox_style: bool, key_cache: torch.Tensor,
                              value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                              static_metadata: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per token; q and k normalised and rotated in place, k and v written to the caches.
    Tokens and heads may be strided (slices of a fused QKV output); each head's D features and the caches'
    head dim must be contiguous. The key goes to the cache in the key's dtype, then the cache's (an FP8 cache: clamped
    to its range), as the unfused pair would write it. Same contract as :func:`qk_norm_rope_cache_ref`.
    static_metadata: the caller's promise that positions, slot_mapping, cos_sin_cache and the weights were not
    written by the kernel launched just before this one (an engine step's metadata); under PDL the kernel then
    reads them before it waits for that kernel (`fxrewrite.kernels.pdl.early_loads`)."""
    num_tokens = positions.numel()
    if num_tokens == 0:
        return query, key
    k, v = key.view(num_tokens, -1, head_size), value.view(num_tokens, -1, head_size)
    check_cache_args(k, v, key_cache, value_cache, slot_mapping)
    q = query.view(num_tokens, -1, head_size)
    check_qk_norm_rope_args(q, k, q_weight, k_weight, head_size, cos_sin_cache)
    clamp = cache_clamp(key_cache.dtype)
    if key_cache.dtype != key.dtype and not clamp:  # keep the unfused pair's two roundings (FP8: in the kernel)
        qk_norm_rope_triton(positions, query, key, q_weight, k_weight, eps, head_size, cos_sin_cache, is_neox_style)
        reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)
        return query, key
    half = cos_sin_cache.shape[-1] // 2
    rest = head_size - 2 * half
    pdl = pdl_enabled(query.device)
    launch(_qk_norm_rope_cache_kernel, (num_tokens,), query.device, pdl)(
        positions, q, k, v, q_weight, k_weight, cos_sin_cache, key_cache, value_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), value_cache.stride(0),
        value_cache.stride(1), value_cache.stride(2), value_cache.stride(3), key_cache.shape[1], q.shape[1], k.shape[1],
        float(eps), CLAMP=clamp,
        HEAD_DIM=head_size, HALF=half, BLOCK_HALF=next_power_of_2(half), PASS=rest,
        BLOCK_PASS=max(1, next_power_of_2(rest)), BLOCK_HQ=next_power_of_2(q.shape[1]),
        BLOCK_HK=next_power_of_2(k.shape[1]), BLOCK_D=next_power_of_2(head_size), IS_NEOX=is_neox_style,
        PDL=pdl, EARLY=early_loads(pdl, static_metadata), num_warps=4)
    return query, key
