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


def moe_layout(llm) -> dict:
    """How this process's model splits its experts (`model_moe_layout`) and the world size."""
    import torch.distributed as dist

    return {"world_size": dist.get_world_size() if dist.is_initialized() else 1,
            **model_moe_layout(llm.llm_engine.model_runner.model)}


def model_moe_layout(model) -> dict:
    """"fused": per `FusedMoE` layer [local expert count, first expert, expert_parallel, local intermediate width,
    w13's local shape]; "experts_w13": every layer's experts' gate_up_proj shape (fused or not)."""
    from fxrewrite.layers.fused_moe import FusedMoE

    fused = []
    for module in model.modules():
        if isinstance(module, FusedMoE):
            e = module._child("experts")
            fused.append([e.num_local_experts, e.expert_start, e.expert_parallel, e.intermediate_size_per_partition,
                          list(e.w13.shape)])
    w13 = [list(p.shape) for n, p in model.named_parameters() if n.endswith("mlp.experts.gate_up_proj")]
    return {"fused": fused, "experts_w13": w13}


LAYOUT_DIR_ENV = "FXREWRITE_TEST_MOE_LAYOUT_DIR"
"""Where `recording_dp_worker_main` writes each data-parallel worker's `model_moe_layout`."""


def recording_dp_worker_main(local_rank: int, *args) -> None:
    """`dp_worker_main` (put in its place in `dp_executor` by the tests) that writes this worker's
    `model_moe_layout`, once its model is loaded, to $FXREWRITE_TEST_MOE_LAYOUT_DIR/worker{local_rank}.json."""
    from pathlib import Path

    from fxrewrite.runtime.worker import worker as worker_module
    from fxrewrite.runtime.worker.dp_worker import dp_worker_main

    out = Path(os.environ[LAYOUT_DIR_ENV]) / f"worker{local_rank}.json"
    init = worker_module.Worker.__init__

    def recording_init(self, *a, **kw):
        init(self, *a, **kw)
        out.write_text(json.dumps(model_moe_layout(self.runner.model)))

    worker_module.Worker.__init__ = recording_init
    dp_worker_main(local_rank, *args)


def record_dp_layouts(setattr_) -> None:
    """Make the next data-parallel engine's workers record their expert split (`recording_dp_worker_main`);
    `setattr_`: monkeypatch.setattr or setattr. The caller sets $FXREWRITE_TEST_MOE_LAYOUT_DIR."""
    from fxrewrite.runtime.worker import dp_executor

    assert dp_executor.dp_worker_main.__name__ == "dp_worker_main"  # the entry spawned per worker
    setattr_(dp_executor, "dp_worker_main", recording_dp_worker_main)


def read_dp_layouts(layout_dir, num_workers: int) -> list[dict]:
    from pathlib import Path

    return [json.loads((Path(layout_dir) / f"worker{r}.json").read_text()) for r in range(num_workers)]


def ep_layout(tp1: dict, world_size: int, rank: int) -> dict:
    """What expert-parallel rank `rank` of `world_size` holds, from one engine's `model_moe_layout`: experts
    [rank*E/ws, (rank+1)*E/ws), each whole."""
    want = []
    for num_experts, start, ep, width, (_, rows, hidden) in tp1["fused"]:
        assert (start, ep, rows) == (0, False, 2 * width) and num_experts % world_size == 0
        local = num_experts // world_size
        want.append([local, rank * local, True, width, [local, rows, hidden]])
    return {"fused": want, "experts_w13": [w[-1] for w in want]}


def spmd_rank(rank: int, world_size: int, port: int, cases: list[tuple[str, str, dict]], out_path: str) -> None:
    """torchrun-style: every rank runs the same engine at tensor_parallel_size=world_size; each rank writes
    {case index: {"tokens": greedy tokens, "layout": `moe_layout`}} to out_path + f".{rank}"."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    from fxrewrite import distributed
    from tests.distributed.tp_ranks import generate_tokens, make_llm

    distributed.init_from_env("cpu")
    try:
        run = generate_tokens if world_size == 2 else short_tokens
        results = {}
        for i, (path, impl, kwargs) in enumerate(cases):
            llm = make_llm(path, impl, world_size, **kwargs)
            results[str(i)] = {"tokens": run(llm), "layout": moe_layout(llm)}
    finally:
        distributed.destroy()
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(results, f)
