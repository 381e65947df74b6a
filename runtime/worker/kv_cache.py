"""Size and allocate the paged KV cache from a memory budget."""

from __future__ import annotations

import math

import torch

from fxrewrite.errors import UserInputError
from fxrewrite.kernels.paged_decode import default_fp8_dots

# On a CPU without kv_cache_memory_bytes: at most this much, and no more than max_num_seqs full-length
# sequences need.
_CPU_DEFAULT_BYTES = 256 * 2**20


_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for the engine's `kv_cache_dtype` setting ("auto": the model's dtype)."""
    return model_dtype if name == "auto" else _KV_CACHE_DTYPES[name]


def kv_shape(model_config, layers: tuple[int, int] | None = None) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of the attention layers this rank caches: all of them, or
    the [start, end) `layers` of its pipeline stage."""
    start, end = layers if layers is not None else (0, model_config.num_hidden_layers)
    return end - start, model_config.num_key_value_heads, model_config.cache_head_dim


def bytes_per_block(model_config, block_size: int, dtype: torch.dtype, layers: tuple[int, int] | None = None) -> int:
    """K and V of `block_size` tokens in every layer (of the stage's `layers`), in bytes."""
    num_layers, num_kv_heads, head_dim = kv_shape(model_config, layers)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def kv_cache_budget_bytes(config, model_config, device: torch.device, block_bytes: int) -> int:
    """Bytes the KV cache may take: kv_cache_memory_bytes if given; on CUDA, gpu_memory_utilization of
    the device minus what is in use (weights, this process and others) minus an activation estimate."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        activations = _activation_estimate(config, model_config)
        return int(total * config.gpu_memory_utilization) - (total - free) - activations
    max_blocks = config.max_num_seqs * -(-model_config.max_model_len // config.block_size)
    return min(_CPU_DEFAULT_BYTES, max_blocks * block_bytes)


def _activation_estimate(config, model_config) -> int:
    """Rough peak of one forward: a few hidden-sized fp32 buffers per token plus the logits."""
    tokens = config.max_num_batched_tokens
    hidden = model_config.hidden_size * 4 * 16
    return tokens * hidden + config.max_num_seqs * model_config.vocab_size * 4 * 2


def num_kv_blocks(config, model_config, device: torch.device, dtype: torch.dtype,
                  layers: tuple[int, int] | None = None) -> int:
    """How many blocks (of the stage's `layers`) fit in the budget; ValueError naming the budget when
    not even one does."""
    block_bytes = bytes_per_block(model_config, config.block_size, dtype, layers)
    budget = kv_cache_budget_bytes(config, model_config, device, block_bytes)
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise UserInputError(
            f"KV cache budget of {budget} bytes holds no block of {block_bytes} bytes "
            f"(block_size={config.block_size}); raise kv_cache_memory_bytes or gpu_memory_utilization"
        )
    return int(num_blocks)


def allocate_kv_caches(
    model_config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
    layers: tuple[int, int] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim], views of one zeroed
    tensor; indexed by the model's layer index. With a pipeline stage's [start, end) `layers` only those are
    allocated (the other stages' layers get empty [0, ...] tensors). An e4m3 cache under FP8 tensor-core dots
    (``FXREWRITE_KV_FP8_DOTS=float8``) stores each block's values keys-contiguous (the same [num_blocks, block_size,
    Hkv, D] values seen through a permutation: the decode kernel reads V^T, the operand of the e4m3 P.V dot)."""
    num_layers, num_kv_heads, head_dim = kv_shape(model_config, layers)
    start = layers[0] if layers is not None else 0
    shape = (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    try:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    except (torch.OutOfMemoryError, RuntimeError) as e:  # RuntimeError: the CPU allocator's "can't allocate memory"
        if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
            raise
        gib = math.prod(shape) * dtype.itemsize / 2**30
        raise UserInputError(f"the KV cache of {num_blocks} blocks of block_size={block_size} tokens ({gib:.1f} GiB) "
                             f"does not fit in {device}'s memory; lower kv_cache_memory_bytes, gpu_memory_utilization "
                             "or block_size") from None
    values = cache[1]
    if values_keys_contiguous(dtype):  # the same storage laid out [L, num_blocks, Hkv, D, block_size]
        values = values.view(num_layers, num_blocks, num_kv_heads, head_dim, block_size).permute(0, 1, 4, 2, 3)
    empty = cache.new_zeros(0, block_size, num_kv_heads, head_dim)
    return [(cache[0, i - start], values[i - start]) if start <= i < start + num_layers else (empty, empty)
            for i in range(model_config.num_hidden_layers)]


def values_keys_contiguous(dtype: torch.dtype) -> bool:
    """Whether the value cache holds each block's keys contiguous: an e4m3 cache under ``FXREWRITE_KV_FP8_DOTS=float8``
    (H200, 2026-12-03-kv-cache-fp8-v-keys-contiguous-twentysixth.json: 36 layers' decode replayed at 200 x 560 keys
    113.2 us a layer against 137.4 with the values as rows and 120.5 with the default fp16 dots)."""
    return dtype == torch.float8_e4m3fn and default_fp8_dots() == "float8"
