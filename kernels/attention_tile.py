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


FP8_DOTS = ("float16", "query")
"""How dots over an FP8 cache run under a half-precision query: in fp16 (default) or in the query's dtype."""


def fp16_dots(query: torch.Tensor, key_cache: torch.Tensor, fp8_dots: str = "float16") -> bool:
    """The kernels' FP16_DOTS flag: an FP8 cache under a bf16 / fp16 query with `fp8_dots` "float16"."""
    if fp8_dots not in FP8_DOTS:
        raise ValueError(f"paged_attention: fp8_dots={fp8_dots!r}; expected one of {FP8_DOTS}")
    return key_cache.element_size() == 1 and query.dtype != torch.float32 and fp8_dots == "float16"


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
def attention_tile(q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row_ptr, n0, end, q_pos, kvh, scale, soft_cap,
                   sliding_window, block_size, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, offs_d, d_mask,
                   BLOCK_N: tl.constexpr, MASK_CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_ASM: tl.constexpr):
    """Fold keys [n0, min(n0 + BLOCK_N, end)) into (m_i, l_i, acc); q is [M, BLOCK_D]."""
    pos = n0 + tl.arange(0, BLOCK_N)
    n_mask = pos < end
    blk = tl.load(bt_row_ptr + pos // block_size, mask=n_mask, other=0).to(tl.int64)
    slot = pos % block_size
    kv_mask = n_mask[:, None] & d_mask[None, :]
    # an FP8 cache is widened to the query's dtype (module docstring); for a cache in that dtype a no-op
    k = tl.load(kc_ptr + blk[:, None] * kc_s0 + slot[:, None] * kc_s1 + kvh * kc_s2 + offs_d[None, :],
                mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(widen(k, q.dtype, WIDEN_ASM)), input_precision=DOT_PRECISION)
    if HAS_SOFTCAP:
        s = s * scale
        s = soft_cap * (2.0 * tl.sigmoid(2.0 * s / soft_cap) - 1.0) * 1.4426950408889634
    else:
        s = s * (scale * 1.4426950408889634)
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
    v = tl.load(vc_ptr + blk[:, None] * vc_s0 + slot[:, None] * vc_s1 + kvh * vc_s2 + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = widen(v, q.dtype, WIDEN_ASM)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
