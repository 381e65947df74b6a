"""Qwen3's attention prologue in one pass: an RMSNorm over each head of q and of k, then rotary.

Formula (transformers ``Qwen3Attention``): q = q_norm(q.view(..., Hq, D)), k = k_norm(k.view(..., Hkv, D)),
each the Llama RMSNorm ``w * (x * rsqrt(mean(x², -1) + eps)).to(dtype)``, then ``apply_rotary_pos_emb``
on the first ``rotary_dim`` features (neox halves or GPT-J pairs; see :mod:`fxrewrite.kernels.rotary`).
The unfused form is five kernels at decode (two copies of the strided q/k views, two norms, the rotary);
here each token is one program that reads and writes its q and k heads once.
"""

from __future__ import annotations

import torch

from fxrewrite.kernels import use_triton
from fxrewrite.kernels.pdl import gdc_prologue, pdl_enabled
from fxrewrite.kernels.rms_norm import rms_norm_ref
from fxrewrite.kernels.rotary import pair_offsets, rotary_embedding_ref, token_cos_sin
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["qk_norm_rope", "qk_norm_rope_ref", "qk_norm_rope_triton", "check_qk_norm_rope_args"]


def qk_norm_rope_ref(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor,
                     k_weight: torch.Tensor, eps: float, head_size: int, cos_sin_cache: torch.Tensor,
                     is_neox_style: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference; returns new ``(query, key)`` of the input shapes.

    positions int64 [T]; query [T, Hq*D] (or [T, Hq, D]), key [T, Hkv*D] (or [T, Hkv, D]), any float dtype;
    q_weight / k_weight [D]; cos_sin_cache [max_position, rotary_dim] (cos then sin, float32).
    Raises ValueError on inconsistent shapes (from the RMSNorm and rotary references).
    """
    num_tokens = positions.numel()
    q = rms_norm_ref(query.reshape(num_tokens, -1, head_size), q_weight, eps).view(query.shape)
    k = rms_norm_ref(key.reshape(num_tokens, -1, head_size), k_weight, eps).view(key.shape)
    return rotary_embedding_ref(positions, q, k, head_size, cos_sin_cache, is_neox_style)


def qk_norm_rope(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, head_size: int, cos_sin_cache: torch.Tensor,
                 is_neox_style: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton on CUDA (in place; returns the inputs), else :func:`qk_norm_rope_ref`: use the returned tensors."""
    if use_triton(query):
        return qk_norm_rope_triton(positions, query, key, q_weight, k_weight, eps, head_size, cos_sin_cache,
                                   is_neox_style)
    return qk_norm_rope_ref(positions, query, key, q_weight, k_weight, eps, head_size, cos_sin_cache, is_neox_style)


@triton.jit
def norm_weights(w_ptr, off1, off2, imask, offp, pmask):
    """The norm weight's features as `norm_rope_tile` takes them: (w1, w2, wp), float32 rows [1, ...]."""
    w1 = tl.load(w_ptr + off1, mask=imask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + off2, mask=imask, other=0.0).to(tl.float32)[None, :]
    wp = tl.load(w_ptr + offp, mask=pmask, other=0.0).to(tl.float32)[None, :]
    return w1, w2, wp


@triton.jit
def norm_rope_tile(rows, num_heads, w1, w2, wp, cos, sin, eps, off1, off2, imask, offp, pmask,
                   HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    """Normalise and rotate `num_heads` heads of one token (`rows` [BLOCK_H, 1]: each head's first
    feature; w1, w2, wp: `norm_weights`). Returns the rotated pair halves and the pass-through features in
    float32, each already rounded to the input dtype, with their masks: (y1, y2, yp, m1, mp)."""
    hmask = (tl.arange(0, BLOCK_H) < num_heads)[:, None]
    m1 = hmask & imask[None, :]
    mp = hmask & pmask[None, :]
    x1 = tl.load(rows + off1[None, :], mask=m1, other=0.0).to(tl.float32)
    x2 = tl.load(rows + off2[None, :], mask=m1, other=0.0).to(tl.float32)
    xp = tl.load(rows + offp[None, :], mask=mp, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + tl.sum(xp * xp, 1)) / HEAD_DIM + eps)[:, None]
    dtype = rows.dtype.element_ty
    # Llama's order: x̂ rounded to the input dtype, times the weight, rounded again.
    y1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    y2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    yp = (xp * rstd).to(dtype).to(tl.float32) * wp
    return (y1 * cos - y2 * sin).to(dtype), (y2 * cos + y1 * sin).to(dtype), yp.to(dtype), m1, mp


@triton.jit
def store_heads(rows, off1, off2, offp, o1, o2, op, m1, mp):
    """Store `norm_rope_tile`'s outputs at `rows` [BLOCK_H, 1] (cast to the destination's dtype)."""
    dtype = rows.dtype.element_ty
    tl.store(rows + off1[None, :], o1.to(dtype), mask=m1)
    tl.store(rows + off2[None, :], o2.to(dtype), mask=m1)
    tl.store(rows + offp[None, :], op.to(dtype), mask=mp)


@triton.jit
def _norm_rope_heads(base, head_stride, num_heads, w_ptr, cos, sin, eps, off1, off2, imask, offp, pmask,
                     HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    """Normalise and rotate `num_heads` heads of one token in place (rows of a [BLOCK_H, D] tile)."""
    rows = base + tl.arange(0, BLOCK_H)[:, None] * head_stride
    w1, w2, wp = norm_weights(w_ptr, off1, off2, imask, offp, pmask)
    o1, o2, op, m1, mp = norm_rope_tile(rows, num_heads, w1, w2, wp, cos, sin, eps, off1, off2, imask, offp, pmask,
                                        HEAD_DIM, BLOCK_H)
    store_heads(rows, off1, off2, offp, o1, o2, op, m1, mp)


# positions / slot_mapping are slices of the engine's packed step buffers, whose 16-byte alignment
# changes from step to step: not specialised on (one binary for every step)
@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])
def _qk_norm_rope_kernel(pos_ptr, q_ptr, k_ptr, qw_ptr, kw_ptr, cache_ptr, q_tok_stride, q_head_stride,
                         k_tok_stride, k_head_stride, cache_stride, num_q_heads, num_k_heads, eps,
                         HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                         PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_HQ: tl.constexpr,
                         BLOCK_HK: tl.constexpr, IS_NEOX: tl.constexpr, PDL: tl.constexpr):
    gdc_prologue(PDL)
    tok, i, imask, cos, sin = token_cos_sin(pos_ptr, cache_ptr, cache_stride, HALF, BLOCK_HALF)
    off1, off2 = pair_offsets(i, HALF, IS_NEOX)
    j = tl.arange(0, BLOCK_PASS)
    offp = 2 * HALF + j  # features past rotary_dim: normalised, not rotated
    pmask = j < PASS
    _norm_rope_heads(q_ptr + tok * q_tok_stride, q_head_stride, num_q_heads, qw_ptr, cos, sin, eps,
                     off1, off2, imask, offp, pmask, HEAD_DIM, BLOCK_HQ)
    _norm_rope_heads(k_ptr + tok * k_tok_stride, k_head_stride, num_k_heads, kw_ptr, cos, sin, eps,
                     off1, off2, imask, offp, pmask, HEAD_DIM, BLOCK_HK)


def qk_norm_rope_triton(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor,
                        k_weight: torch.Tensor, eps: float, head_size: int, cos_sin_cache: torch.Tensor,
                        is_neox_style: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on ``query`` / ``key`` (each head's D features must be contiguous; tokens and heads may
    be strided, e.g. slices of a fused QKV output). Same contract as :func:`qk_norm_rope_ref`."""
    num_tokens = positions.numel()
    q = query.view(num_tokens, -1, head_size)
    k = key.view(num_tokens, -1, head_size)
    check_qk_norm_rope_args(q, k, q_weight, k_weight, head_size, cos_sin_cache)
    if num_tokens == 0:
        return query, key
    half, rest = cos_sin_cache.shape[-1] // 2, head_size - cos_sin_cache.shape[-1]
    pdl = pdl_enabled(query.device)
    launch(_qk_norm_rope_kernel, (num_tokens,), query.device, pdl)(
        positions, q, k, q_weight, k_weight, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos_sin_cache.stride(0), q.shape[1], k.shape[1], float(eps),
        HEAD_DIM=head_size, HALF=half, BLOCK_HALF=next_power_of_2(half), PASS=rest,
        BLOCK_PASS=max(1, next_power_of_2(rest)), BLOCK_HQ=next_power_of_2(q.shape[1]),
        BLOCK_HK=next_power_of_2(k.shape[1]), IS_NEOX=is_neox_style, PDL=pdl, num_warps=4)
    return query, key


def check_qk_norm_rope_args(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                            head_size: int, cos_sin_cache: torch.Tensor) -> None:
    """ValueError unless q [T, Hq, D] / k [T, Hkv, D] / cos_sin_cache have a contiguous last dim, the rotary
    dim is even and <= head_size, and both weights are [head_size]."""
    rotary_dim = cos_sin_cache.shape[-1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("qk_norm_rope: the head dim of query/key/cos_sin_cache must be contiguous")
    if rotary_dim % 2 or rotary_dim > head_size or q_weight.shape != (head_size,) or k_weight.shape != (head_size,):
        raise ValueError(f"qk_norm_rope: rotary_dim={rotary_dim} (even, <= {head_size}) and q/k weights "
                         f"{tuple(q_weight.shape)}/{tuple(k_weight.shape)} (expected [{head_size}])")
