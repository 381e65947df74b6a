"""A data-parallel worker process: TP rank t of replica d (`fxrewrite.data_parallel` has the layout).

Each step the driver (`fxrewrite.runtime.worker.dp_executor`) broadcasts a *wave*: one `StepMessage`
(or None) per replica. A worker applies its replica's message to its `SequenceMirror` and launches the
step as a tensor-parallel worker does (`fxrewrite.runtime.worker.worker.Worker`); its replica's TP rank 0
sends the sampled tokens back on that replica's results group, one reply per wave (empty when the
replica had no work). Under DP x EP every replica's token count is noted before the step, and a replica
with no work still runs every MoE layer's collectives, so all workers' collectives line up: a wave of
decode steps only (one token per sequence, every replica) runs in CUDA graphs, every replica padded to
one bucket (`wave_bucket`; an idle replica replays that bucket on padding rows); any other wave runs
eagerly with the noted counts (an idle replica calls the MoE layers with zero tokens, `run_idle`).
``None`` means shut down.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import threading

import torch
import torch.distributed as dist

from fxrewrite import data_parallel, distributed
from fxrewrite.layers.fused_moe import FusedMoE
from fxrewrite.layers.moe_dp import experts_across_dp
from fxrewrite.sharding_moe import experts_across_replicas
from fxrewrite.runtime.worker.step_messages import STEP_FIELDS
from fxrewrite.runtime.worker.worker import (ControlMessage, ResultSender, Worker, _watch_parent, broadcast_object,
                                             exit_worker)
from fxrewrite.runtime.worker.cpu_threads import size_cpu_threads
from fxrewrite.runtime.worker.step_channel import GlooChannel
from fxrewrite.runtime.worker import watchdog
from fxrewrite.runtime.worker.worker_processes import reporting_user_errors

logger = logging.getLogger(__name__)

_NUM_NEW = STEP_FIELDS.index("num_new_tokens")

DP_EP_GRAPHS_ENV = "FXREWRITE_DP_EP_CUDA_GRAPHS"
"""0: DP x EP decode waves run eagerly (no CUDA graphs on any replica), as before graphs were added."""

_MAX_BUCKETS = 64


def wave_token_counts(wave: list) -> list[int]:
    """Tokens each replica computes in a wave (0 for a replica without a message or scheduled rows)."""
    return [0 if m is None else int(m.steps[:, _NUM_NEW].sum()) for m in wave]


def wave_bucket(wave: list, counts: list[int], graphs) -> int:
    """The decode graph bucket every replica replays in this wave (same on every worker: it depends
    on the wave only), or 0 when the wave runs eagerly: a replica has a step with more than one token
    for a sequence (prefill), or more sequences than the largest bucket, or no replica has tokens."""
    longest = max(counts)
    if not graphs.graphs or longest == 0 or longest > graphs.max_batch_size:
        return 0
    if any(m is not None and bool((m.steps[:, _NUM_NEW] != 1).any()) for m in wave):
        return 0
    return graphs.bucket(longest)


@torch.inference_mode()
def run_idle(model: torch.nn.Module) -> None:
    """A replica with no tokens this step: take part in every MoE layer's collectives (fused ones, and
    transformers' experts modules split over the workers), in forward order (the modules' registration
    order is the decoder layers' order)."""
    for module in model.modules():
        if isinstance(module, FusedMoE):
            router = module._child("router")
            experts_across_dp(module, router.weight.new_empty(0, router.weight.shape[1]))
        elif (hooks := experts_across_replicas(module)) is not None:
            hooks.run_idle(module)


def agree_on_graphs(graphs, group, device) -> object | None:
    """The graph runner when every worker of `group` (all DP x EP workers) captured the same buckets,
    else None on every worker, with a warning: replicas replaying different buckets would issue MoE
    collectives of different sizes and hang. One collective (a MIN and a MAX all-reduce) over `group`."""
    sizes = sorted(graphs.graphs) if graphs is not None else []
    if os.environ.get(DP_EP_GRAPHS_ENV) == "0":
        sizes = []
    row = torch.zeros(2, _MAX_BUCKETS, dtype=torch.int64, device=device)
    row[0, : len(sizes)] = torch.tensor(sizes[:_MAX_BUCKETS], dtype=torch.int64)
    row[1] = -row[0]  # the MAX of -sizes is -MIN: one all-reduce gives both
    dist.all_reduce(row, op=dist.ReduceOp.MAX, group=group)
    agreed = bool(torch.equal(row[0], -row[1])) and len(sizes) <= _MAX_BUCKETS
    if agreed and sizes:
        return graphs
    if not agreed:
        logger.warning("data-parallel replicas captured different CUDA graph buckets (here %s); decode "
                       "waves run eagerly on every replica", sizes)
    return None


def check_model_shares_experts(model: torch.nn.Module) -> None:
    """DP x EP needs MoE layers that carry the cross-replica collectives: fused ones, or transformers' experts
    modules split over the workers (`fxrewrite.sharding_moe`); RuntimeError otherwise."""
    if not any(isinstance(m, FusedMoE) or experts_across_replicas(m) is not None for m in model.modules()):
        raise RuntimeError("data_parallel_size > 1 with enable_expert_parallel needs MoE layers whose experts the "
                           "replicas can share: fused MoE layers, or transformers' experts modules (use_experts_"
                           "implementation) whose expert count divides by the worker count; this model has none")


def dp_worker_main(local_rank: int, config, model_config, eos_token_ids: set[int], host: str, port: int,
                   dp_size: int, tp_size: int, parent_pid: int) -> None:
    """torch.multiprocessing entry point of worker `local_rank` (global rank local_rank + 1)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's: it shuts us down
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    watchdog.install(f"DP rank {local_rank // tp_size} TP rank {local_rank % tp_size} (pid {os.getpid()})")
    watchdog.phase("joining the process groups")
    backend = distributed.default_backend(config.device)
    config = copy.copy(config)
    num_workers = dp_size * tp_size
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        config.device = f"cuda:{local_rank}"
    else:
        size_cpu_threads(num_workers)
        config.device = config.device or "cpu"
    rank = local_rank + 1
    store = dist.TCPStore(host, port, num_workers + 1, is_master=False, timeout=distributed.TP_TIMEOUT)
    store.set(f"fxrewrite/worker_ready/{rank}", "1")
    state, _ = data_parallel.initialize(rank, store, dp_size, tp_size, backend, config.enable_expert_parallel)
    with reporting_user_errors(store, rank):
        worker = Worker(config, model_config, eos_token_ids)
    shares_experts = data_parallel.dp_ep_active()
    graphs = None
    if shares_experts:
        check_model_shares_experts(worker.runner.model)
        watchdog.phase("agreeing on the CUDA graph buckets across replicas")
        graphs = agree_on_graphs(worker.runner.graph_runner, data_parallel.get_state().ep_group, worker.runner.device)
        worker.runner.graph_runner = graphs  # None: the runner must not replay a graph on its own either
    watchdog.phase("sending the load report to the driver")
    with reporting_user_errors(store, rank):
        num_blocks = worker.num_blocks()
    info = {"num_blocks": num_blocks, "impl": getattr(worker.runner.model, "impl", None),
            "compiled": bool(getattr(worker.runner.model, "_fxrewrite_compiled", False)),
            "cuda_graph_buckets": len(worker.runner.graph_runner.graphs) if worker.runner.graph_runner else 0}
    leader = rank == state.results_rank
    if leader:
        broadcast_object(info, rank, state.driver_group)
    watchdog.phase(f"loaded ({info['cuda_graph_buckets']} CUDA graph buckets)")
    # DP steps travel over gloo (one wave per engine step for every replica; no shared-memory ring yet)
    sender = ResultSender(GlooChannel(rank, state.driver_group), config.device) if leader else None
    serve_waves(worker, graphs, shares_experts, sender)
    exit_worker(sender)


def serve_waves(worker: Worker, graphs, shares_experts: bool, sender: ResultSender | None) -> None:
    """The worker's loop: one wave per engine step until the driver's None (see the module docstring)."""
    dp_rank, step, num_waves = data_parallel.get_state().dp_rank, None, 0
    while True:
        watchdog.phase("waiting for the driver's next wave", watched=False)
        if (wave := broadcast_object(None, 0)) is None:
            return
        if isinstance(wave, ControlMessage):  # the driver refuses these under data parallelism
            continue
        counts = wave_token_counts(wave)
        data_parallel.set_step_token_counts(counts)
        if graphs is not None:
            graphs.step_bucket = wave_bucket(wave, counts, graphs)
        num_waves += 1
        bucket = graphs.step_bucket if graphs is not None else 0
        kind = f"graph bucket {bucket}" if bucket else "eager"
        watchdog.phase(f"wave {num_waves}: tokens per replica {counts}, {kind}", log=False)
        msg = wave[dp_rank]
        launched = worker.launch(msg, step) if msg is not None else None
        if launched is None and shares_experts and max(counts) > 0:
            if bucket:
                with torch.inference_mode():
                    graphs.run_idle(bucket)
            else:
                run_idle(worker.runner.model)
        step = launched or step
        if sender is not None:
            sender.send(launched)
