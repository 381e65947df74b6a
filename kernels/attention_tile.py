"""What the paged decode and prefill kernels share: the argument checks (also the reference's) and one
key/value tile of paged attention with an online softmax, the loop body (``@triton.jit`` helper, inlined
by triton).

An FP8 cache (scale 1.0) is widened in the tile to the query's dtype. Under a bf16 / fp16 query the kernels
first turn the query into fp16 (``FP16_DOTS``, clamped to its range): e4m3 -> fp16 is one PTX conversion per
pair of values on sm89+, e4m3 -> bf16 takes a second one per value (the probabilities, in [0, 1], lose nothing
in fp16). On sm89+ the widening is inline PTX (``WIDEN_ASM``): triton moves a plain ``.to`` of a tile past the
tile's trip through shared memory (the dot operands' layout), and 8-bit values come back from there one byte
per load (``ld.shared.b8`` in the sm90 PTX, where the bf16 kernel loads 16 bytes at a time; the CPU suite checks
the PTX: tests/kernels/sm90_compile.py); opaque, the conversion stays in registers after the global load and the fp16 tile takes bf16's path.

Scores live in the log2 domain (``exp2``): ``s = log2(e) * scale * q·k`` (or the soft-capped
``log2(e) * cap * tanh(scale * q·k / cap)``); ``m`` is the running row max and ``l`` the running
sum of ``exp2(s - m)``, both float32 (FlashAttention-2's recurrence).
"""

from __future__ import annotations

import math

import torch

from fxrewrite.kernels.triton_utils import tl, triton

LOG2E = 1.4426950408889634


def check_paged_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc) -> None:
    """Shape checks shared by the reference and the kernels; ValueError naming the bad shape."""
    if query.dim() != 3:
        raise ValueError(f"paged_attention: query shape {tuple(query.shape)}; expected [T, Hq, D]")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"paged_attention: caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)}; "
                         "expected equal [num_blocks, block_size, Hkv, D]")
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    if query.shape[2] != head_size or query.shape[1] % num_kv_heads:
        raise ValueError(f"paged_attention: query {tuple(query.shape)} vs cache heads {num_kv_heads} x "
                         f"{head_size}; expected the same head_size and Hq a multiple of Hkv")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] < num_seqs:
        raise ValueError(f"paged_attention: {num_seqs} seq_lens, {query_start_loc.shape[0]} query_start_loc "
                         f"entries, {block_tables.shape[0]} block table rows; expected B, B+1, >= B")


def check_last_dim_contiguous(*tensors: torch.Tensor) -> None:
    """The kernels index the head dim with unit stride."""
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"paged_attention: a tensor of shape {tuple(t.shape)} has stride {t.stride()}; "
                             "expected a contiguous last (head) dim")


def sinks_arg(sinks: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    """The kernels' sinks pointer: float32 contiguous [Hq] sink logits (natural log), or `query` as an unused
    placeholder when there are none. ValueError unless sinks is [Hq]."""
    if sinks is None:
        return query
    if sinks.shape != (query.shape[1],):
        raise ValueError(f"paged_attention: sinks shape {tuple(sinks.shape)}; expected [Hq] = [{query.shape[1]}]")
    return sinks.float().contiguous()


def value_run(value_cache: torch.Tensor, block_n: int) -> int:
    """The kernels' V_RUN: 0 for a value cache [num_blocks, block_size, Hkv, D] with a contiguous head dim; for one
    that holds each block's keys contiguous (a [num_blocks, Hkv, D, block_size] tensor seen through ``permute(0, 3, 1,
    2)``) the keys a tile loads as one run, gcd(block_size, block_n) (>= 1: 1 for an odd block size). ValueError
    naming the strides for any other layout."""
    if value_cache.stride(-1) == 1 and (value_cache.stride(1) != 1 or value_cache.shape[1] == 1):
        return 0
    if value_cache.stride(1) != 1:
        raise ValueError(f"paged_attention: value cache strides {value_cache.stride()}; expected a contiguous head dim "
                         "or contiguous keys in each block")
    return math.gcd(value_cache.shape[1], block_n)


def keys_contiguous(value_cache: torch.Tensor) -> torch.Tensor:
    """The same values [num_blocks, block_size, Hkv, D] stored with each block's keys contiguous (a [num_blocks, Hkv,
    D, block_size] tensor seen through ``permute(0, 3, 1, 2)``): the value-cache layout the keys-major decode tile
    reads as V^T (:func:`value_run`)."""
    return value_cache.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


FP8_DOTS = ("float16", "query", "float8")
"""How dots over an FP8 cache run under a half-precision query: in fp16 (default), in the query's dtype, or (decode
only, e4m3 cache) on FP8 tensor cores: the query quantized to e4m3 per head, the probabilities as e4m3 (x 256)."""


def fp16_dots(query: torch.Tensor, key_cache: torch.Tensor, fp8_dots: str = "float16") -> bool:
    """The kernels' FP16_DOTS flag: an FP8 cache under a bf16 / fp16 query with `fp8_dots` "float16"."""
    if fp8_dots not in FP8_DOTS:
        raise ValueError(f"paged_attention: fp8_dots={fp8_dots!r}; expected one of {FP8_DOTS}")
    return key_cache.element_size() == 1 and query.dtype != torch.float32 and fp8_dots == "float16"


def float8_dots(query: torch.Tensor, key_cache: torch.Tensor, fp8_dots: str = "float16") -> bool:
    """The decode kernel's F8_DOTS flag: `fp8_dots` "float8" over an e4m3 cache under a bf16 / fp16 query."""
    if fp8_dots not in FP8_DOTS:
        raise ValueError(f"paged_attention: fp8_dots={fp8_dots!r}; expected one of {FP8_DOTS}")
    return key_cache.dtype == torch.float8_e4m3fn and query.dtype != torch.float32 and fp8_dots == "float8"


def widen_asm(query: torch.Tensor, key_cache: torch.Tensor, fp8_dots: str = "float16") -> int:
    """The kernels' WIDEN_ASM: 1 (e4m3) / 2 (e5m2) for fp16 dots over an FP8 cache on a CUDA sm89+ GPU, else 0."""
    if not fp16_dots(query, key_cache, fp8_dots) or key_cache.device.type != "cuda" \
            or torch.cuda.get_device_capability(key_cache.device) < (8, 9):
        return 0
    return 1 if key_cache.dtype == torch.float8_e4m3fn else 2


@triton.jit
def widen(x, dtype, WIDEN_ASM: tl.constexpr):
    """A loaded FP8 / half-precision tile in `dtype`; WIDEN_ASM: FP8 -> fp16 in inline PTX first (docstring)."""
    if WIDEN_ASM == 1:
        x = tl.inline_asm_elementwise("cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [x.to(tl.uint8, bitcast=True)],
                                      dtype=tl.float16, is_pure=False, pack=2)
    elif WIDEN_ASM == 2:
        x = tl.inline_asm_elementwise("cvt.rn.f16x2.e5m2x2 $0, $1;", "=r,h", [x.to(tl.uint8, bitcast=True)],
                                      dtype=tl.float16, is_pure=False, pack=2)
    return x.to(dtype)


@triton.jit
def dot_dtype(q, FP16_DOTS: tl.constexpr):
    """The query as the tile's dots take it: fp16 (clamped to +-65504) with FP16_DOTS, else as loaded."""
    if FP16_DOTS:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return q


@triton.jit
def to_e4m3(x, EXACT_CAST: tl.constexpr):
    """float32 `x` (within +-448) as e4m3, nearest. EXACT_CAST (for triton's CPU interpreter, whose float32 -> FP8
    cast loses the mantissa carry: 1.99 -> 1.0): x is first rounded to 3 mantissa bits in float32 (ties to even),
    which the cast then keeps."""
    if EXACT_CAST:
        bits = x.to(tl.int32, bitcast=True)
        x = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    return x.to(tl.float8e4nv)


@triton.jit
def quantize_query(q, EXACT_CAST: tl.constexpr):
    """A [M, D] query tile as e4m3 with one float32 scale a row (its amax over 448; 1 for an all-zero row)."""
    q = q.to(tl.float32)
    amax = tl.max(tl.abs(q), axis=1)
    q_scale = tl.where(amax > 0.0, amax / 448.0, 1.0)
    return to_e4m3(q / q_scale[:, None], EXACT_CAST), q_scale


# Probabilities (<= 1) go to e4m3 times this, out of its subnormal range; the P.V dot's result is scaled back.
P_SCALE = tl.constexpr(256.0)


@triton.jit
def tile_slots(bt_row_ptr, n0, end, block_size, BLOCK_N: tl.constexpr):
    """Keys [n0, n0 + BLOCK_N) of a sequence: their positions, which are < end, and their (block, slot) in the cache."""
    pos = n0 + tl.arange(0, BLOCK_N)
    n_mask = pos < end
    blk = tl.load(bt_row_ptr + pos // block_size, mask=n_mask, other=0).to(tl.int64)
    return pos, n_mask, blk, pos % block_size


@triton.jit
def log2_scores(s, scale, soft_cap, HAS_SOFTCAP: tl.constexpr):
    """q.k dot products as the online softmax takes them: scaled (and soft-capped), in the log2 domain."""
    if HAS_SOFTCAP:
        s = s * scale
        return soft_cap * (2.0 * tl.sigmoid(2.0 * s / soft_cap) - 1.0) * 1.4426950408889634
    return s * (scale * 1.4426950408889634)


@triton.jit
def attention_tile(q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row_ptr, n0, end, q_pos, kvh, scale, soft_cap,
                   sliding_window, block_size, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, vc_s3, offs_d, d_mask,
                   BLOCK_N: tl.constexpr, MASK_CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_ASM: tl.constexpr,
                   V_RUN: tl.constexpr):
    """Fold keys [n0, min(n0 + BLOCK_N, end)) into (m_i, l_i, acc); q is [M, BLOCK_D]. V_RUN > 0: a keys-contiguous
    value cache (:func:`value_tile_t`; n0 a multiple of V_RUN); only a MASK_CAUSAL tile may reach past `end`."""
    pos, n_mask, blk, slot = tile_slots(bt_row_ptr, n0, end, block_size, BLOCK_N)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    # an FP8 cache is widened to the query's dtype (module docstring); for a cache in that dtype a no-op
    k = tl.load(kc_ptr + blk[:, None] * kc_s0 + slot[:, None] * kc_s1 + kvh * kc_s2 + offs_d[None, :],
                mask=kv_mask, other=0.0)
    s = log2_scores(tl.dot(q, tl.trans(widen(k, q.dtype, WIDEN_ASM)), input_precision=DOT_PRECISION), scale,
                    soft_cap, HAS_SOFTCAP)
    visible = n_mask[None, :]
    if MASK_CAUSAL:
        visible = visible & (pos[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if V_RUN > 0:
        v = tl.trans(value_tile_t(vc_ptr, bt_row_ptr, pos, end, block_size, kvh, vc_s0, vc_s2, vc_s3, offs_d, d_mask,
                                  V_RUN, MASK_CAUSAL))
    else:
        v = tl.load(vc_ptr + blk[:, None] * vc_s0 + slot[:, None] * vc_s1 + kvh * vc_s2 + offs_d[None, :],
                    mask=kv_mask, other=0.0)
    v = widen(v, q.dtype, WIDEN_ASM)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def decode_tile_keys_major(q, q_scale, m_i, l_i, acc_t, kc_ptr, vc_ptr, bt_row_ptr, n0, first, end, kvh, scale,
                           soft_cap, block_size, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, vc_s3, offs_d, d_mask,
                           BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
                           DOT_PRECISION: tl.constexpr, WIDEN_ASM: tl.constexpr, F8_DOTS: tl.constexpr,
                           EXACT_CAST: tl.constexpr, V_RUN: tl.constexpr, PARTIAL: tl.constexpr):
    """:func:`attention_tile` for one decode token's G' query heads (q: [G', BLOCK_D]) with the keys along the
    MMA's M side: scores s^T = K q^T [BLOCK_N, G'] and acc_t = (P V)^T [BLOCK_D, G'], so the heads are the MMA's N
    (8 and up) and the softmax touches BLOCK_N x G' values, where heads as rows are padded to M (16 for mma.sync,
    64 for wgmma: with FP8 dots that way the kernel ran 2x slower than its fp16 dots on an H200). F8_DOTS: q is
    e4m3 with row scales `q_scale` (:func:`quantize_query`), both dots take the e4m3 cache tiles as loaded and the
    probabilities enter the second as e4m3 x `P_SCALE`; otherwise the tiles are widened as in attention_tile.
    Keys before `first` are masked with HAS_WINDOW. V_RUN > 0: the value cache holds each block's keys contiguous
    (`vc_s1` == 1, head dim at stride `vc_s3`; :func:`value_tile_t`), PARTIAL: the tile may reach past `end`."""
    pos, n_mask, blk, slot = tile_slots(bt_row_ptr, n0, end, block_size, BLOCK_N)
    if HAS_WINDOW:
        n_mask = n_mask & (pos >= first)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(kc_ptr + blk[:, None] * kc_s0 + slot[:, None] * kc_s1 + kvh * kc_s2 + offs_d[None, :],
                mask=kv_mask, other=0.0)
    if F8_DOTS:
        s = tl.dot(k, tl.trans(q)) * q_scale[None, :]
    else:
        s = tl.dot(widen(k, q.dtype, WIDEN_ASM), tl.trans(q), input_precision=DOT_PRECISION)
    s = log2_scores(s, scale, soft_cap, HAS_SOFTCAP)
    s = tl.where(n_mask[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    if V_RUN > 0:
        v_t = value_tile_t(vc_ptr, bt_row_ptr, pos, end, block_size, kvh, vc_s0, vc_s2, vc_s3, offs_d, d_mask, V_RUN,
                           PARTIAL)
    else:
        v_t = tl.trans(tl.load(vc_ptr + blk[:, None] * vc_s0 + slot[:, None] * vc_s1 + kvh * vc_s2 + offs_d[None, :],
                               mask=kv_mask, other=0.0))
    if F8_DOTS:
        acc_t = acc_t * alpha[None, :] + tl.dot(v_t, to_e4m3(p * P_SCALE, EXACT_CAST)) * (1.0 / P_SCALE)
    else:
        v_t = widen(v_t, q.dtype, WIDEN_ASM)
        acc_t = acc_t * alpha[None, :] + tl.dot(v_t, p.to(v_t.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc_t


@triton.jit
def value_tile_t(vc_ptr, bt_row_ptr, pos, end, block_size, kvh, vc_s0, vc_s2, vc_s3, offs_d, d_mask,
                 V_RUN: tl.constexpr, PARTIAL: tl.constexpr):
    """V^T [BLOCK_D, BLOCK_N] of the keys at `pos` from a value cache that holds each block's keys contiguous (slot
    stride 1), the K-major operand an FP8 wgmma takes as is (a [keys, D] tile would be transposed through registers).
    The keys come in whole runs of V_RUN slots of one block (`pos` starts at a multiple of V_RUN); told to the compiler
    (hints on ops made here: triton drops a hint on a value a called function returns), the loads are 16-byte
    vectors (cp.async into shared memory). Keys at or past `end` must read as zeros, not just weigh 0: a slot not
    written for this sequence may hold anything, NaN included (NaN * 0 = NaN). A full tile (not PARTIAL) has none;
    a PARTIAL one loads the runs that start before `end` and zeroes the rest in registers."""
    in_seq = pos < end
    blk = tl.max_constancy(tl.load(bt_row_ptr + pos // block_size, mask=in_seq, other=0), V_RUN).to(tl.int64)
    slot = tl.max_contiguous(tl.multiple_of(pos % block_size, V_RUN), V_RUN)
    ptrs = vc_ptr + blk[None, :] * vc_s0 + kvh * vc_s2 + offs_d[:, None] * vc_s3 + slot[None, :]
    if PARTIAL:
        run_in_seq = tl.max_constancy(pos // V_RUN * V_RUN < end, V_RUN)
        v_t = tl.load(ptrs, mask=d_mask[:, None] & run_in_seq[None, :], other=0.0)
        return tl.where(in_seq[None, :], v_t, tl.zeros_like(v_t))
    return tl.load(ptrs, mask=d_mask[:, None], other=0.0)
