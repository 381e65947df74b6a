"""Rank body for test_training_parallel: DDP and FSDP2 (fully_shard) over gloo on CPU, optimized tiny Llama."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def batch():
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 96, (4, 8), generator=gen)
    labels = ids.clone()
    labels[:, :2] = -100
    return ids, labels


def fused_model():
    from tests.e2e.tiny_models import tiny_model

    import fxrewrite

    return fxrewrite.optimize(tiny_model("llama")).train()


def _hf_grads(model, named):
    from fxrewrite.weights import to_hf_names

    return {k: v.detach().clone() for k, v in to_hf_names(model, named).items()}


def run_rank(rank: int, world: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ids, labels = batch()
        mine = slice(rank * 2, rank * 2 + 2)
        results = {}
        model = fused_model()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        loss = ddp(ids[mine], labels=labels[mine]).loss
        loss.backward()
        results["ddp"] = (float(loss.detach()), _hf_grads(model, {n: p.grad for n, p in model.named_parameters()}))
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = fused_model()
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        loss = model(ids[mine], labels=labels[mine]).loss
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        results["fsdp2"] = (float(loss.detach()), _hf_grads(model, grads))
        if rank == 0:
            torch.save(results, out_path)
        dist.barrier()  # both ranks past their last collective before teardown: a rank destroying the group
        # while the other still used it aborted with "terminate called without an active exception" (2 loaded cores)
    finally:
        dist.destroy_process_group()
