"""Rank entry point for the MoE parallel tests (own module: spawned children import it by name)."""

from __future__ import annotations

import json
import os

import torch


def short_tokens(llm) -> list[list[int]]:
    """Greedy tokens of two short prompts, 4 each (the 4/8-rank runs: 8 processes on a 2-core CI)."""
    from fxrewrite.runtime.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([[1, 2, 3, 4, 5], [7] * 3], params, use_tqdm=False)]


def spmd_rank(rank: int, world_size: int, port: int, cases: list[tuple[str, str, dict]], out_path: str) -> None:
    """torchrun-style: every rank runs the same engine at tensor_parallel_size=world_size; rank 0
    writes {case index: greedy tokens}."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    from fxrewrite import distributed
    from tests.distributed.tp_ranks import generate_tokens, make_llm

    distributed.init_from_env("cpu")
    try:
        run = generate_tokens if world_size == 2 else short_tokens
        results = {str(i): run(make_llm(path, impl, world_size, **kwargs)) for i, (path, impl, kwargs) in enumerate(cases)}
    finally:
        distributed.destroy()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
