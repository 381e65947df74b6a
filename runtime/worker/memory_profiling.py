"""Size the KV cache on CUDA from a profiling forward at the step's token budget (vLLM's method).

    kv_bytes = total * gpu_memory_utilization - (memory in use after loading) - activation_peak

`activation_peak` is the allocator's peak during one forward of `max_num_batched_tokens` tokens (split
into sequences of at most max_model_len tokens) plus the logits and sampler work of `max_num_seqs`
rows, measured above what was allocated before it. "Memory in use" comes from the driver
(`cudaMemGetInfo`), so weights, the CUDA context and other processes are all counted.
"""

from __future__ import annotations

import torch
from torch import nn

from fxrewrite import data_parallel
from fxrewrite.errors import UserInputError
from fxrewrite.runtime.worker.compilation import forward_or_fallback, forwards_of, model_forwards
from fxrewrite.runtime.worker.forward_context import AttentionMetadata, forward_context
from fxrewrite.runtime.worker.kv_cache import allocate_kv_caches, bytes_per_block


def _dummy_metadata(num_tokens: int, seq_len: int, block_size: int, device: torch.device):
    """Prefill metadata for `num_tokens` tokens in sequences of `seq_len` (the last one shorter), each in
    its own contiguous run of blocks; returns (positions [T], metadata, number of blocks used)."""
    lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    blocks_per_seq = -(-seq_len // block_size)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    positions = torch.cat([torch.arange(n) for n in lens])
    slots = torch.cat([b * blocks_per_seq * block_size + torch.arange(n) for b, n in enumerate(lens)])
    tables = torch.arange(len(lens) * blocks_per_seq, dtype=torch.int32).view(len(lens), blocks_per_seq)
    metadata = AttentionMetadata(
        slot_mapping=slots.to(device), block_tables=tables.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        max_query_len=max(lens), max_seq_len=max(lens),
    )
    return positions.to(device), metadata, len(lens) * blocks_per_seq


@torch.inference_mode()
def profile_activation_bytes(model: nn.Module, config, model_config, device: torch.device, kv_dtype: torch.dtype,
                             layers: tuple[int, int] | None = None) -> int:
    """Peak bytes one worst-case step allocates beyond what is live before it (weights, scratch cache). A compiled
    model whose steps may run either forward (`compilation.compiled_model_forwards`) is profiled through both, the
    larger peak counting (the eager forward keeps intermediates that Inductor's fused kernels do not)."""
    num_tokens = config.max_num_batched_tokens
    seq_len = min(model_config.max_model_len, num_tokens)
    positions, metadata, num_blocks = _dummy_metadata(num_tokens, seq_len, config.block_size, device)
    metadata.kv_caches = allocate_kv_caches(model_config, num_blocks, config.block_size, kv_dtype, device, layers)
    input_ids = torch.randint(0, model_config.vocab_size, (num_tokens,), device=device)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    for kind in model_forwards(model):
        hidden = None  # the previous forward's output is not live during the next one
        # Every DP x EP replica profiles the same batch: uniform row counts, no token-count exchange.
        with forward_context(metadata), data_parallel.uniform_tokens(), forwards_of(kind):
            hidden = forward_or_fallback(model, input_ids, positions)  # the compiled one: also its compiling call
    rows = min(config.max_num_seqs, num_tokens)
    logits = model.compute_logits(hidden[:rows]).float()
    # The sampler keeps a few [rows, vocab] float32 tensors alive (log-softmax, a sort, probabilities).
    torch.log_softmax(logits, dim=-1).sort(dim=-1, descending=True)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del hidden, logits, metadata
    torch.cuda.empty_cache()
    return int(peak)


def profile_num_kv_blocks(model: nn.Module, config, model_config, device: torch.device, kv_dtype: torch.dtype,
                          layers: tuple[int, int] | None = None) -> int:
    """Number of KV blocks that fit in gpu_memory_utilization after a profiling forward.

    ValueError naming the budget when not even one block fits."""
    activation = profile_activation_bytes(model, config, model_config, device, kv_dtype, layers)
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * config.gpu_memory_utilization) - (total - free) - activation
    block_bytes = bytes_per_block(model_config, config.block_size, kv_dtype, layers)
    if budget < block_bytes:
        raise UserInputError(
            f"KV cache budget of {budget} bytes (gpu_memory_utilization={config.gpu_memory_utilization} of "
            f"{total} bytes, {total - free} in use, activation peak {activation}) holds no block of "
            f"{block_bytes} bytes; raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return int(budget // block_bytes)
