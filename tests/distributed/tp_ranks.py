"""Rank entry points for the tensor-parallel tests (a module of its own, so spawned children import
it by name without re-importing the test module)."""

from __future__ import annotations

import json
import os

import torch

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7] * 3]
MAX_TOKENS = 8


def make_llm(path: str, impl: str, tensor_parallel_size: int = 1, **kwargs):
    """A float32 CPU engine with small blocks and chunked prefill (16 tokens a step); impl "transformers/unfused":
    the transformers backend with fusion=False."""
    from fxrewrite.runtime.llm import LLM

    impl, _, variant = impl.partition("/")
    if variant == "unfused":
        kwargs["fusion"] = False

    kwargs = {"kv_cache_memory_bytes": 1 << 22, **kwargs}
    return LLM(path, model_impl=impl, dtype="float32", block_size=4, max_num_batched_tokens=16, device="cpu",
               tensor_parallel_size=tensor_parallel_size, **kwargs)


def sampling_params():
    """Per prompt: greedy, seeded temperature sampling with 2 completions, seeded top-k with penalties."""
    from fxrewrite.runtime.engine.sampling_params import SamplingParams

    return [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=2, presence_penalty=0.5, max_tokens=MAX_TOKENS,
                       ignore_eos=True),
    ]


def generate_tokens(llm, params=None) -> list[list[list[int]]]:
    """Token ids of every completion of every prompt of PROMPTS; checks no KV block is left in use."""
    from fxrewrite.runtime.engine.sampling_params import SamplingParams

    params = params or SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def greedy_tokens(path: str, impl: str, tensor_parallel_size: int = 1) -> list[list[list[int]]]:
    return generate_tokens(make_llm(path, impl, tensor_parallel_size))


def shard_layout(llm) -> dict:
    """What this process's model holds (evidence of tensor-parallel sharding): the world and TP size, the
    first layer's attention projections' local weight shapes ([q|k|v] rows, or q_proj's unfused; o_proj),
    its dense MLP's (None for experts), transformers' unfused experts' gate_up_proj (None for a dense MLP) and the
    LM head's local vocabulary rows and first row."""
    import torch.distributed as dist

    from fxrewrite import distributed

    model = llm.llm_engine.model_runner.model
    params = dict(model.named_parameters())

    def shape(*suffixes):
        found = [list(p.shape) for n, p in params.items() if n.endswith(suffixes)]
        return found[0] if found else None

    head = next(m for n, m in model.named_modules() if n.endswith("lm_head"))
    return {"world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "tp_size": distributed.get_tp_size(), "tp_rank": distributed.get_tp_rank(),
            "qkv": shape(".layers.0.self_attn.qkv_proj.weight", ".layers.0.self_attn.q_proj.weight"),
            "o_proj": shape(".layers.0.self_attn.o_proj.weight"),
            "gate_up": shape(".layers.0.mlp.gate_up_proj.weight"),
            "down": shape(".layers.0.mlp.down_proj.weight"),
            "experts": shape(".layers.0.mlp.experts.gate_up_proj"),
            "lm_head": [head.weight.shape[0], getattr(head, "vocab_start_index", 0)]}


def spmd_rank(rank: int, port: int, cases: list[tuple[str, str]], out_path: str) -> None:
    """torchrun-style rank: every rank runs the same TP=2 engine; each rank writes {case: {"tokens", "layout"}}
    (`shard_layout`) to out_path + f".{rank}"."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    from fxrewrite import distributed

    distributed.init_from_env("cpu")
    try:
        results = {}
        for path, impl in cases:
            llm = make_llm(path, impl, 2)
            results[f"{path}|{impl}"] = {"tokens": generate_tokens(llm), "layout": shard_layout(llm)}
    finally:
        distributed.destroy()
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(results, f)
