"""Rank entry point for the MoE parallel tests (own module: spawned children import it by name)."""

from __future__ import annotations

import contextlib
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


EXPERTS_DP_CASES = [("gpt_oss", "eager"), ("gpt_oss", "batched_mm"), ("qwen2_moe", "grouped_mm")]
EXPERTS_DP_CALLS = [((5, 3), "noted"), ((4, 0), "gathered"), ((2, 2), "uniform")]
"""Rows per replica of each call of `experts_dp_rank`, and how the layer learns them: the worker's step note,
an all-gather of the counts (replica 1 idle: `run_idle`), `data_parallel.uniform_tokens()` (CUDA graph buckets)."""


def tiny_experts_model(family: str):
    """The first layer's transformers experts module's model: GPT-OSS (clamped SwiGLU, biases, 4 experts) or
    a `tests.moe.conftest.tiny_moe` family; float32, the same weights on every call."""
    from tests.moe.conftest import tiny_moe

    if family != "gpt_oss":
        return tiny_moe(family)
    from transformers import AutoModelForCausalLM, GptOssConfig

    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                          num_experts_per_tok=2, initializer_range=0.2)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def experts_dp_rank(rank: int, port: int, out_path: str) -> None:
    """Worker `rank` of 2 data-parallel replicas (tp 1, expert parallel, gloo): shards each case's model
    (`fxrewrite.sharding.shard_model`) and runs its first experts module on this replica's rows of each call of
    EXPERTS_DP_CALLS. Saves (torch.save) to out_path + f".{rank}" per case: "local" (the sharded module's
    parameters, num_experts, global_num_experts, full_shape of each, the plan's style), and per call "out" (None
    when idle), "want" (the unsharded module's output on the same rows) and "partial" (this worker's output on
    the gathered rows, before the sums)."""
    import copy

    import torch.distributed as dist

    from fxrewrite import data_parallel
    from fxrewrite.runtime.worker.weight_sync import full_shape, plan_update
    from fxrewrite.sharding import shard_model
    from fxrewrite.sharding_moe import experts_across_replicas

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    # the state `data_parallel.initialize` builds for a worker, without the driver: both groups are the world
    data_parallel._dp = data_parallel.DataParallelState(2, rank, dist.group.WORLD, dist.group.WORLD, True)
    results = {}
    for family, impl in EXPERTS_DP_CASES:
        model = tiny_experts_model(family)
        model.config._experts_implementation = impl
        whole = copy.deepcopy(model.model.layers[0].mlp.experts)
        plan = shard_model(model, tp_rank=0, tp_size=1)
        prefix = "model.layers.0.mlp.experts"  # weight sync takes the full tensors
        plan_update(model, [(n, tuple(p.shape)) for n, p in whole.named_parameters(prefix=prefix)], strict=False)
        local = model.model.layers[0].mlp.experts
        case = {"local": {"style": plan.get("model.layers.0.mlp.experts"), "num_experts": local.num_experts,
                          "global_num_experts": getattr(local, "global_num_experts", None),
                          "params": {n: p.detach().clone() for n, p in local.named_parameters()},
                          "full_shapes": {n: full_shape(local, p, None) for n, p in local.named_parameters()},
                          "whole": {n: p.detach().clone() for n, p in whole.named_parameters()}}, "calls": []}
        partials = []
        local.register_forward_hook(lambda m, a, out: partials.append(out.clone()), prepend=True)  # before the sums
        gen = torch.Generator().manual_seed(1)
        for counts, how in EXPERTS_DP_CALLS:
            # every replica's rows, drawn alike on both workers; two distinct experts per token
            rows = [(torch.randn(n, 32, generator=gen),
                     torch.rand(n, whole.num_experts, generator=gen).argsort(1)[:, :2],
                     torch.rand(n, 2, generator=gen)) for n in counts]
            x, ids, weights = rows[rank]
            data_parallel.set_step_token_counts(counts if how == "noted" else None)
            with torch.no_grad(), (data_parallel.uniform_tokens() if how == "uniform" else contextlib.nullcontext()):
                if counts[rank]:
                    out, want = local(x, ids, weights), whole(x, ids, weights)
                else:  # an idle replica: zero rows, its part in the collectives only
                    out = want = experts_across_replicas(local).run_idle(local)
            case["calls"].append({"out": out, "want": want, "partial": partials.pop()})
        results[f"{family}/{impl}"] = case
    dist.destroy_process_group()
    torch.save(results, f"{out_path}.{rank}")
