"""Data-parallel state of an engine worker: its DP rank, the DP / EP groups, and this step's token counts.

Layout (`initialize`, with the driver as world rank 0): worker ``1 + d * tp_size + t`` is TP rank t of
data-parallel replica d. Groups, all created by every rank in the same order (creation is collective):
- per replica, its TP group (attention and dense layers stay inside the replica);
- per TP rank t, a DP group of the replicas' rank t: MoE layers all-gather tokens over it;
- one EP group of every worker: with expert parallelism the experts are split over all dp x tp
  workers (vLLM's DP attention + EP MoE), and the experts' partial outputs are summed over it;
- per replica, a gloo (driver, replica's TP rank 0) group that carries its sampled tokens back.

Outside a DP x EP engine (the default) `dp_ep_active()` is False and MoE layers behave as before.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from fxrewrite import distributed


@dataclasses.dataclass
class DataParallelState:
    dp_size: int
    dp_rank: int
    dp_group: object
    """Same TP rank of every replica (MoE token all-gather)."""
    ep_group: object
    """Every worker (sum of the experts' partial outputs)."""
    expert_parallel: bool
    step_token_counts: list[int] | None = None
    """Tokens of this step on each replica, set by the worker per step (None: all-gathered by the layer)."""
    uniform_tokens: bool = False
    """Every replica calls the MoE layers with the same row count (CUDA graph capture of a bucket)."""


_dp: DataParallelState | None = None


def initialize(rank: int, store, dp_size: int, tp_size: int, backend: str,
               expert_parallel: bool) -> tuple[distributed.ParallelState, list[tuple[int, object]]]:
    """Join the world of 1 + dp_size * tp_size ranks (rank 0 the driver) and build every group above.

    Returns this rank's `fxrewrite.distributed.ParallelState` (tp group of its replica; ``driver_group``
    its replica's results group, ``results_rank`` that replica's TP rank 0) and, per replica, (its TP
    rank 0's global rank, its results group): the driver receives on each. RuntimeError if already
    initialized."""
    global _dp
    world = 1 + dp_size * tp_size
    if distributed.get_state() is not None or dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process")
    distributed.init_gloo_world(rank, world, distributed.CONTROL_TIMEOUT, driver=rank == 0, store=store)
    replicas = [[1 + d * tp_size + t for t in range(tp_size)] for d in range(dp_size)]
    columns = [[replicas[d][t] for d in range(dp_size)] for t in range(tp_size)]
    mine: dict[str, tuple] = {}
    for key, lists in (("tp", replicas), ("dp", columns)):
        for ranks in lists:
            group = dist.new_group(ranks, backend=backend, timeout=distributed.TP_TIMEOUT)
            if rank in ranks:
                mine[key] = (tuple(ranks), group)
    ep_group = dist.new_group(list(range(1, world)), backend=backend, timeout=distributed.TP_TIMEOUT)
    results = []
    for ranks in replicas:
        group = dist.new_group([0, ranks[0]], backend="gloo", timeout=distributed.CONTROL_TIMEOUT)
        results.append((ranks[0], group))
        if rank in ranks:
            mine["driver"] = (ranks[0], group)
    if rank == 0:
        state = distributed.ParallelState(0, world, tuple(replicas[0]), None)
    else:
        tp_ranks, tp_group = mine["tp"]
        leader, driver_group = mine["driver"]
        state = distributed.ParallelState(rank, world, tp_ranks, tp_group, driver_group, results_rank=leader)
        _dp = DataParallelState(dp_size, (rank - 1) // tp_size, mine["dp"][1], ep_group, expert_parallel)
    distributed.set_state(state)
    return state, results


def get_state() -> DataParallelState | None:
    return _dp


def reset() -> None:
    global _dp
    _dp = None


def dp_ep_active() -> bool:
    """True on a worker of a dp_size > 1 engine with expert parallelism (MoE layers go across replicas)."""
    return _dp is not None and _dp.expert_parallel and _dp.dp_size > 1


def moe_parallel(tp_size: int | None = None, tp_rank: int | None = None) -> tuple[int, int, bool]:
    """(size, rank, expert_parallel) over which MoE experts are split on this process: every worker of
    every replica under DP x EP (rank = dp_rank * tp_size + tp_rank), else the TP group (`tp_size` /
    `tp_rank` when given, else this process's)."""
    tp_size = distributed.get_tp_size() if tp_size is None else tp_size
    tp_rank = distributed.get_tp_rank() if tp_rank is None else tp_rank
    if dp_ep_active():
        return _dp.dp_size * tp_size, _dp.dp_rank * tp_size + tp_rank, True
    return tp_size, tp_rank, distributed.expert_parallel_enabled()


def set_step_token_counts(counts: list[int] | None) -> None:
    """The worker's per-step note of every replica's token count (None clears it)."""
    if _dp is not None:
        _dp.step_token_counts = None if counts is None else [int(c) for c in counts]


@contextlib.contextmanager
def uniform_tokens():
    """While active, MoE layers take every replica's row count to be their own (no step note, no
    host-read counts: capturable in a CUDA graph); the callers on every replica must use equal sizes.
    A no-op outside a DP x EP worker."""
    if _dp is None:
        yield
        return
    before, _dp.uniform_tokens = _dp.uniform_tokens, True
    try:
        yield
    finally:
        _dp.uniform_tokens = before


def all_workers_ok(ok: bool, device) -> bool:
    """True when `ok` is True on every DP x EP worker (a MIN all-reduce over the EP group, a host sync):
    a step that may fail on one replica (a CUDA graph capture) must fail on all, or they part ways."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=_dp.ep_group)
    return bool(flag.item())
