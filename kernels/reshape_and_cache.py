"""Write this step's keys and values into the paged KV cache (vLLM ``reshape_and_cache``).

Cache layout [num_blocks, block_size, num_kv_heads, head_size]; token t goes to block
``slot_mapping[t] // block_size``, offset ``slot_mapping[t] % block_size``. A negative slot
(padding, or a token whose KV is already cached) is skipped.

An FP8 cache (``--kv-cache-dtype fp8``) stores the values with scale 1.0, clamped to the format's finite
range first (vLLM's convention without checkpoint KV scales; a plain cast would make out-of-range values
NaN on the GPU).
"""

from __future__ import annotations

import torch

from fxrewrite.kernels import use_triton
from fxrewrite.kernels.attention_tile import value_run
from fxrewrite.kernels.pdl import gdc_prologue, pdl_enabled
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["reshape_and_cache", "reshape_and_cache_ref", "check_cache_args", "cache_clamp", "to_cache_dtype"]


def cache_clamp(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 cache dtype, 0.0 for any other (no clamp)."""
    return float(torch.finfo(dtype).max) if dtype.itemsize == 1 and dtype.is_floating_point else 0.0


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as the cache stores it: cast, FP8 after clamping to its finite range."""
    limit = cache_clamp(dtype)
    return (x.clamp(-limit, limit) if limit else x).to(dtype)


def _check(key, value, key_cache, value_cache, slot_mapping) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"reshape_and_cache: key {tuple(key.shape)} / value {tuple(value.shape)}; "
                         "expected equal shapes [num_tokens, num_kv_heads, head_size]")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape or key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"reshape_and_cache: caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)}; "
                         f"expected equal [num_blocks, block_size, {key.shape[1]}, {key.shape[2]}]")
    if slot_mapping.shape[0] < key.shape[0]:
        raise ValueError(f"reshape_and_cache: slot_mapping has {slot_mapping.shape[0]} entries for "
                         f"{key.shape[0]} tokens; expected one per token")


def check_cache_args(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """The kernels' checks: the reference's shapes, and a contiguous last (head) dim everywhere but in a value cache
    that holds each block's keys contiguous (:func:`~fxrewrite.kernels.attention_tile.keys_contiguous`; ValueError)."""
    _check(key, value, key_cache, value_cache, slot_mapping)
    value_run(value_cache, 1)
    for t in (key, value, key_cache):
        if t.stride(-1) != 1:
            raise ValueError(f"reshape_and_cache: a tensor of shape {tuple(t.shape)} has strides {t.stride()}; "
                             "expected a contiguous last (head) dim")


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Torch reference, writes in place. key/value [T, Hkv, D]; caches [N, block_size, Hkv, D]
    (values cast to the cache dtype); slot_mapping int [T] (extra entries ignored, < 0 skipped).
    Raises ValueError on inconsistent shapes."""
    _check(key, value, key_cache, value_cache, slot_mapping)
    slots = slot_mapping[: key.shape[0]].long()
    keep = slots >= 0
    slots = slots[keep]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    for src, cache in ((key, key_cache), (value, value_cache)):
        # Indexing (not a flat view) so caches sliced out of a larger tensor work too.
        cache[blocks, offsets] = to_cache_dtype(src[keep], cache.dtype)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter key/value into the caches; Triton on CUDA, else :func:`reshape_and_cache_ref`."""
    if use_triton(key):
        return reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping)
    return reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping)


# positions / slot_mapping are slices of the engine's packed step buffers, whose 16-byte alignment
# changes from step to step: not specialised on (one binary for every step)
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _reshape_and_cache_kernel(key_ptr, value_ptr, kc_ptr, vc_ptr, slot_ptr, k_s0, k_s1, v_s0, v_s1,
                              kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, vc_s3, block_size, num_heads,
                              HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                              FP8: tl.constexpr, CLAMP: tl.constexpr, PDL: tl.constexpr):
    gdc_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_heads) & (d < HEAD_DIM)
        k = tl.load(key_ptr + tok * k_s0 + h * k_s1 + d, mask=mask)
        v = tl.load(value_ptr + tok * v_s0 + h * v_s1 + d, mask=mask)
        if FP8:  # an FP8 cache: its finite range (see the module docstring)
            k = tl.minimum(tl.maximum(k.to(tl.float32), -CLAMP), CLAMP)
            v = tl.minimum(tl.maximum(v.to(tl.float32), -CLAMP), CLAMP)
        tl.store(kc_ptr + blk * kc_s0 + off * kc_s1 + h * kc_s2 + d, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + blk * vc_s0 + off * vc_s1 + h * vc_s2 + d * vc_s3, v.to(vc_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache_triton(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton kernel, one program per token; same contract as :func:`reshape_and_cache_ref`.
    Any strides (e.g. transposed HF [Hkv, T, D] views) except a non-unit head-dim stride (but in a keys-contiguous
    value cache)."""
    check_cache_args(key, value, key_cache, value_cache, slot_mapping)
    num_heads, head_dim = key.shape[1], key.shape[2]
    if key.shape[0]:
        pdl = pdl_enabled(key.device)
        launch(_reshape_and_cache_kernel, (key.shape[0],), key.device, pdl)(
            key, value, key_cache, value_cache, slot_mapping, key.stride(0), key.stride(1),
            value.stride(0), value.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), value_cache.stride(3),
            key_cache.shape[1], num_heads,
            HEAD_DIM=head_dim, BLOCK_H=next_power_of_2(num_heads), BLOCK_D=next_power_of_2(head_dim),
            FP8=cache_clamp(key_cache.dtype) > 0, CLAMP=cache_clamp(key_cache.dtype), PDL=pdl, num_warps=4)
