"""Rotary position embedding on q and k in one pass: neox (halves) and GPT-J (interleaved), partial rotary.

``cos_sin_cache`` [max_position, rotary_dim] holds cos in its first half and sin in its second
(vLLM's layout, built by ``fxrewrite.layers.rotary``); only the first ``rotary_dim`` features of
each head rotate. Formula (transformers ``apply_rotary_pos_emb``): with (x1, x2) the two halves
(neox) or the even/odd features (GPT-J), out1 = x1*cos - x2*sin and out2 = x2*cos + x1*sin.
"""

from __future__ import annotations

import torch

from fxrewrite.kernels import use_triton
from fxrewrite.kernels.pdl import gdc_prologue, pdl_enabled
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["rotary_embedding", "rotary_embedding_ref"]


def _heads(x: torch.Tensor, num_tokens: int, head_size: int, name: str) -> torch.Tensor:
    if x.numel() % (num_tokens * head_size):
        raise ValueError(f"rotary_embedding: {name} shape {tuple(x.shape)} is not [num_tokens={num_tokens}, "
                         f"num_heads * head_size={head_size}] (or [..., num_heads, head_size])")
    return x.view(num_tokens, -1, head_size)


def _check_cache(cos_sin_cache: torch.Tensor, head_size: int) -> int:
    rotary_dim = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(f"rotary_embedding: cos_sin_cache shape {tuple(cos_sin_cache.shape)}; expected "
                         f"[max_position, rotary_dim] with an even rotary_dim <= head_size={head_size}")
    return rotary_dim


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool) -> torch.Tensor:
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def _outputs(query, key, query_out, key_out, rotary_dim: int, head_size: int):
    """(query_out, key_out), defaulting to (query, key): in place. Outputs other than the inputs take every feature
    of a head, so the rotary must cover the whole head; ValueError otherwise, for a missing key_out, or for a shape or
    dtype unlike its input's."""
    if query_out is None and key_out is None:
        return query, key
    if query_out is None or (key_out is None) != (key is None):
        raise ValueError("rotary_embedding: query_out and key_out go together (key_out None only without a key)")
    if rotary_dim != head_size:
        raise ValueError(f"rotary_embedding: separate outputs need rotary_dim == head_size; got {rotary_dim} of "
                         f"{head_size} (a partial rotary rotates in place)")
    for name, x, out in (("query", query, query_out), ("key", key, key_out)):
        if x is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
            raise ValueError(f"rotary_embedding: {name}_out {tuple(out.shape)} {out.dtype} {out.device} is not "
                             f"like {name} {tuple(x.shape)} {x.dtype} {x.device}")
    return query_out, key_out


def rotary_embedding_ref(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                         head_size: int, cos_sin_cache: torch.Tensor, is_neox_style: bool = True, *,
                         query_out: torch.Tensor | None = None, key_out: torch.Tensor | None = None):
    """Torch reference; returns new ``(query, key)`` of the input shapes (key may be None), or with query_out /
    key_out (shaped and typed as query / key; a full-head rotary only) writes the results there and returns them.

    positions int64 [T] or [B, S]; query [..., Hq*D] or [..., Hq, D] with T tokens in front
    (likewise key with Hkv heads); math in the query dtype with cos/sin cast to it, as
    transformers does. Raises ValueError on inconsistent shapes.
    """
    rotary_dim = _check_cache(cos_sin_cache, head_size)
    _outputs(query, key, query_out, key_out, rotary_dim, head_size)
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    outs = []
    for name, x in (("query", query), ("key", key)):
        if x is None:
            outs.append(None)
            continue
        h = _heads(x, num_tokens, head_size, name)
        rot = _rotate(h[..., :rotary_dim], cos, sin, is_neox_style)
        outs.append(torch.cat((rot, h[..., rotary_dim:]), dim=-1).view(x.shape))
    if query_out is not None:
        query_out.copy_(outs[0])
        return query_out, key_out if key is None else key_out.copy_(outs[1])
    return outs[0], outs[1]


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     head_size: int, cos_sin_cache: torch.Tensor, is_neox_style: bool = True):
    """Rotary on q and k; returns ``(query, key)``. The Triton path rotates in place (and returns
    the inputs), the reference returns new tensors: callers use the returned tensors."""
    if use_triton(query):
        return rotary_embedding_triton(positions, query, key, head_size, cos_sin_cache, is_neox_style)
    return rotary_embedding_ref(positions, query, key, head_size, cos_sin_cache, is_neox_style)


@triton.jit
def token_cos_sin(pos_ptr, cache_ptr, cache_stride, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The prologue every rotary kernel shares (one program per token): returns the token index, the
    feature lanes i [BLOCK_HALF] with their mask i < HALF, and cos, sin [1, BLOCK_HALF] in float32 (0 past
    HALF) read from the cache row of the token's position (cos in the row's first half, sin in the second)."""
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    imask = i < HALF
    cos = tl.load(cache_ptr + pos * cache_stride + i, mask=imask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * cache_stride + HALF + i, mask=imask, other=0.0).to(tl.float32)[None, :]
    return tok, i, imask, cos, sin


@triton.jit
def pair_offsets(i, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """Offsets in a head of the two features lane i rotates together: (i, i + HALF) for neox halves,
    (2i, 2i + 1) for GPT-J pairs."""
    if IS_NEOX:
        off1 = i
        off2 = i + HALF
    else:
        off1 = 2 * i
        off2 = 2 * i + 1
    return off1, off2


@triton.jit
def _rotate_halves(src, dst, src_off, dst_off, rows, i, imask, cos, sin, HALF: tl.constexpr):
    """neox: features i and i + HALF of the selected `rows` (heads at src + src_off) rotated into dst + dst_off (the
    same place, in place), float32 math."""
    m = rows[:, None] & imask[None, :]
    p1 = src + src_off[:, None] + i[None, :]
    x1 = tl.load(p1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=m, other=0.0).to(tl.float32)
    o1 = dst + dst_off[:, None] + i[None, :]
    tl.store(o1, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=m)
    tl.store(o1 + HALF, (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=m)


@triton.jit
def _rotate_pairs(src, dst, src_off, dst_off, rows, cos, sin, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """GPT-J: features 2i and 2i + 1, loaded contiguously and split in registers (stride-2 loads/stores ran at 6%
    of copy bandwidth on an H200), rotated into dst + dst_off (the same place, in place)."""
    j = tl.arange(0, 2 * BLOCK_HALF)
    m = rows[:, None] & (j < 2 * HALF)[None, :]
    x1, x2 = tl.split(tl.reshape(tl.load(src + src_off[:, None] + j[None, :], mask=m, other=0.0).to(tl.float32),
                                 [BLOCK_H, BLOCK_HALF, 2]))
    out = tl.reshape(tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin), [BLOCK_H, 2 * BLOCK_HALF])
    tl.store(dst + dst_off[:, None] + j[None, :], out.to(dst.dtype.element_ty), mask=m)


# positions / slot_mapping are slices of the engine's packed step buffers, whose 16-byte alignment
# changes from step to step: not specialised on (one binary for every step)
@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, qo_ptr, ko_ptr, cache_ptr, q_tok_stride, q_head_stride, k_tok_stride,
                   k_head_stride, qo_tok_stride, qo_head_stride, ko_tok_stride, ko_head_stride, cache_stride,
                   num_q_heads, num_k_heads, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   IS_NEOX: tl.constexpr, HAS_KEY: tl.constexpr, PDL: tl.constexpr):
    gdc_prologue(PDL)
    tok, i, imask, cos, sin = token_cos_sin(pos_ptr, cache_ptr, cache_stride, HALF, BLOCK_HALF)
    heads = tl.arange(0, BLOCK_H)
    # q heads are rows [0, num_q_heads), k heads follow; one tile covers both.
    is_q = heads < num_q_heads
    is_k = (heads >= num_q_heads) & (heads < num_q_heads + num_k_heads)
    q_row, k_row = heads * q_head_stride, (heads - num_q_heads) * k_head_stride
    qo_row, ko_row = heads * qo_head_stride, (heads - num_q_heads) * ko_head_stride
    q_tok, k_tok = q_ptr + tok * q_tok_stride, k_ptr + tok * k_tok_stride
    qo_tok, ko_tok = qo_ptr + tok * qo_tok_stride, ko_ptr + tok * ko_tok_stride
    if IS_NEOX:
        _rotate_halves(q_tok, qo_tok, q_row, qo_row, is_q, i, imask, cos, sin, HALF)
        if HAS_KEY:
            _rotate_halves(k_tok, ko_tok, k_row, ko_row, is_k, i, imask, cos, sin, HALF)
    else:
        _rotate_pairs(q_tok, qo_tok, q_row, qo_row, is_q, cos, sin, HALF, BLOCK_HALF, BLOCK_H)
        if HAS_KEY:
            _rotate_pairs(k_tok, ko_tok, k_row, ko_row, is_k, cos, sin, HALF, BLOCK_HALF, BLOCK_H)


def rotary_embedding_triton(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                            head_size: int, cos_sin_cache: torch.Tensor, is_neox_style: bool = True,
                            *, num_warps: int = 4, query_out: torch.Tensor | None = None,
                            key_out: torch.Tensor | None = None):
    """Triton kernel, one program per token, q and k heads in one tile; rotates in place, or into query_out /
    key_out (`_outputs`), and returns the rotated (query, key)."""
    rotary_dim = _check_cache(cos_sin_cache, head_size)
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    q = _heads(query, num_tokens, head_size, "query")
    k = _heads(key, num_tokens, head_size, "key") if key is not None else q
    qo, ko = _outputs(query, key, query_out, key_out, rotary_dim, head_size)
    qo = _heads(qo, num_tokens, head_size, "query_out")
    ko = _heads(ko, num_tokens, head_size, "key_out") if key is not None else qo
    if any(t.stride(-1) != 1 for t in (q, k, qo, ko, cos_sin_cache)):
        raise ValueError("rotary_embedding: the head dim of query/key (and their outputs)/cos_sin_cache must be "
                         "contiguous")
    num_k_heads = k.shape[1] if key is not None else 0
    half = rotary_dim // 2
    if num_tokens:
        pdl = pdl_enabled(query.device)
        launch(_rotary_kernel, (num_tokens,), query.device, pdl)(
            positions, q, k, qo, ko, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0),
            qo.stride(1), ko.stride(0), ko.stride(1), cos_sin_cache.stride(0), q.shape[1], num_k_heads,
            HALF=half, BLOCK_HALF=next_power_of_2(half), BLOCK_H=next_power_of_2(q.shape[1] + num_k_heads),
            IS_NEOX=is_neox_style, HAS_KEY=key is not None, PDL=pdl, num_warps=num_warps)
    return (query, key) if query_out is None else (query_out, key_out)
