"""Rank entry point for the MoE parallel tests (own module: spawned children import it by name)."""

from __future__ import annotations

import json
import os

import torch


def spmd_rank(rank: int, world_size: int, port: int, cases: list[tuple[str, str, dict]], out_path: str) -> None:
    """torchrun-style: every rank runs the same engine at tensor_parallel_size=world_size; rank 0
    writes {case index: greedy tokens}."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    from fxrewrite import distributed
    from tests.distributed.tp_ranks import generate_tokens, make_llm

    distributed.init_from_env("cpu")
    try:
        results = {str(i): generate_tokens(make_llm(path, impl, world_size, **kwargs))
                   for i, (path, impl, kwargs) in enumerate(cases)}
    finally:
        distributed.destroy()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
