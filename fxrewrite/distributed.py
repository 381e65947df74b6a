"""Tensor-parallel state over `torch.distributed`: tp_rank / tp_size, the TP group, collectives.

Two layouts, both plain `torch.distributed` (its own TCPStore / env:// rendezvous, nothing else on
the wire):
- engine (`fxrewrite.runtime.worker.executor`): world rank 0 is the driver (schedules, never computes),
  ranks 1..N are the N tensor-parallel workers; the default group (gloo) carries the step messages,
  the TP group (NCCL on CUDA, gloo on CPU) carries the model's all-reduce / all-gather.
- SPMD (``torchrun``, or any launcher that sets MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE):
  every rank is a TP rank and runs the same program (`init_from_env`).

Outside either (the default) tp_size is 1, tp_rank 0 and every collective here is a no-op, so the
layers in `fxrewrite.layers` work unchanged in a single process.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys

import torch
import torch.distributed as dist

from fxrewrite.symm_all_reduce import SymmMemAllReduce

# Collectives inside a model step: a peer that stops answering for this long is an error.
TP_TIMEOUT = datetime.timedelta(minutes=10)
# The driver/worker control group may sit idle for as long as the server has no requests.
CONTROL_TIMEOUT = datetime.timedelta(days=365)


@dataclasses.dataclass
class ParallelState:
    """What `initialize` set up. ``tp_group`` is None on the driver (it is not a TP rank)."""

    rank: int
    """Global rank in the default group."""
    world_size: int
    tp_ranks: tuple[int, ...]
    """Global ranks of the TP group, in TP-rank order."""
    tp_group: object | None
    driver_group: object | None = None
    """Group of (driver, TP rank 0 of the last pipeline stage): how sampled tokens go back; None in SPMD."""
    pp_ranks: tuple[int, ...] = ()
    """Global ranks of this rank's pipeline column (same TP rank in every stage), in stage order."""
    pp_group: object | None = None

    @property
    def pp_size(self) -> int:
        return max(1, len(self.pp_ranks))

    @property
    def pp_rank(self) -> int:
        return self.pp_ranks.index(self.rank) if self.rank in self.pp_ranks else 0

    results_rank: int = 1
    """Global rank that sends sampled tokens to the driver: TP rank 0 of the last pipeline stage."""

    @property
    def tp_size(self) -> int:
        return len(self.tp_ranks)

    @property
    def tp_rank(self) -> int:
        return self.tp_ranks.index(self.rank) if self.rank in self.tp_ranks else 0


_state: ParallelState | None = None
_symm_all_reduce: SymmMemAllReduce | None = None


def default_backend(device: torch.device | str | None = None) -> str:
    """"nccl" for CUDA devices, else "gloo"."""
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    return "nccl" if kind == "cuda" else "gloo"


def init_gloo_world(rank: int, world_size: int, timeout, driver: bool = False, **kwargs) -> None:
    """`dist.init_process_group("gloo", ...)`. On the driver (the user's own process) without torch's excepthook,
    which prefixes "[rankN]: " to every line of every uncaught traceback, the user's own included."""
    hook = sys.excepthook
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    if driver:
        sys.excepthook = hook


def initialize(rank: int, world_size: int, *, store=None, tp_ranks: list[int] | None = None,
               with_driver: bool = False, tp_backend: str = "gloo", pp_size: int = 1) -> ParallelState:
    """Join the default group (gloo) and build the TP group.

    `store`: a `torch.distributed.Store` (the executor's TCPStore); None means env:// (MASTER_ADDR,
    MASTER_PORT). `tp_ranks`: global ranks of the TP group (default: all). `with_driver`: rank 0 is
    the driver, and a (0, tp_ranks[0]) group is made for the results. Every rank of the world must
    call this with the same arguments except `rank` (group creation is collective).
    `pp_size` > 1 (pipeline parallelism, with the driver): `tp_ranks` holds every worker, stage by
    stage; each stage gets its own TP group and each TP rank a pipeline group across the stages.
    Raises RuntimeError if already initialized.
    """
    global _state
    if _state is not None or dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process")
    tp_ranks = list(range(world_size)) if tp_ranks is None else list(tp_ranks)
    kwargs = {"store": store} if store is not None else {"init_method": "env://"}
    init_gloo_world(rank, world_size, CONTROL_TIMEOUT if with_driver else TP_TIMEOUT, driver=with_driver and rank == 0,
                    **kwargs)
    if pp_size > 1:
        _state = _initialize_pipeline(rank, world_size, tp_ranks, pp_size, tp_backend)
        return _state
    if tp_backend == "gloo" and len(tp_ranks) == world_size and not with_driver:
        tp_group = dist.group.WORLD
    else:
        tp_group = dist.new_group(tp_ranks, backend=tp_backend, timeout=TP_TIMEOUT)
    driver_group = dist.new_group([0, tp_ranks[0]], backend="gloo", timeout=CONTROL_TIMEOUT) if with_driver else None
    _state = ParallelState(rank, world_size, tuple(tp_ranks), tp_group if rank in tp_ranks else None, driver_group,
                           results_rank=tp_ranks[0])
    return _state


def _initialize_pipeline(rank: int, world_size: int, workers: list[int], pp_size: int, backend: str) -> ParallelState:
    """Groups of a driver + `pp_size` stages of len(workers) / pp_size TP ranks (every rank creates
    every group, in the same order: group creation is collective)."""
    tp_size = len(workers) // pp_size
    stages = [workers[s * tp_size:(s + 1) * tp_size] for s in range(pp_size)]
    columns = [[stage[t] for stage in stages] for t in range(tp_size)]
    mine = {"tp": None, "pp": None}
    for key, ranks_list in (("tp", stages), ("pp", columns)):
        for ranks in ranks_list:
            group = dist.new_group(ranks, backend=backend, timeout=TP_TIMEOUT)
            if rank in ranks:
                mine[key] = (tuple(ranks), group)
    driver_group = dist.new_group([0, stages[-1][0]], backend="gloo", timeout=CONTROL_TIMEOUT)
    tp_ranks, tp_group = mine["tp"] or (tuple(stages[0]), None)
    pp_ranks, pp_group = mine["pp"] or ((), None)
    return ParallelState(rank, world_size, tp_ranks, tp_group, driver_group, pp_ranks, pp_group, stages[-1][0])


def get_pp_size() -> int:
    """Number of pipeline stages (1 without pipeline parallelism)."""
    return _state.pp_size if _state is not None else 1


def get_pp_rank() -> int:
    """This process's pipeline stage (0 without pipeline parallelism)."""
    return _state.pp_rank if _state is not None else 0


def init_from_env(device: torch.device | str | None = None) -> ParallelState:
    """SPMD: every rank is a TP rank; RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the
    environment (what torchrun sets). On CUDA, LOCAL_RANK picks the device. ValueError when a
    variable is missing."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"init_from_env needs the environment variables {missing} (as torchrun sets them)")
    backend = default_backend(device)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return initialize(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), tp_backend=backend)


def get_state() -> ParallelState | None:
    return _state


def set_state(state: ParallelState) -> None:
    """Install groups built elsewhere (`fxrewrite.data_parallel.initialize`)."""
    global _state
    _state = state


def _is_tp_rank() -> bool:
    return _state is not None and _state.tp_group is not None


def get_tp_size() -> int:
    """Number of TP ranks; 1 outside a TP setup and on the driver (it builds no model shard)."""
    return _state.tp_size if _is_tp_rank() else 1


def get_tp_rank() -> int:
    """This process's TP rank (0 outside a TP setup and on the driver)."""
    return _state.tp_rank if _is_tp_rank() else 0


def get_tp_group():
    return _state.tp_group if _state is not None else None


def destroy() -> None:
    """Tear the groups down (idempotent)."""
    global _state, _symm_all_reduce
    _state = None
    _symm_all_reduce = None
    if dist.is_initialized():
        dist.destroy_process_group()


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the TP ranks (in place, returned); `x` itself at tp_size 1."""
    if get_tp_size() == 1:
        return x
    return all_reduce_tp_shards(x)


def all_reduce_tp_shards(x: torch.Tensor) -> torch.Tensor:
    """Sum of a row-parallel layer's partial outputs over the TP group (in place, returned): through
    symmetric memory when enabled and `x` is small enough, else `torch.distributed.all_reduce` on the
    TP group (the default group when none is set up, as for layers built with an explicit tp_size)."""
    if _symm_all_reduce is not None and _symm_all_reduce.can_run(x):
        return _symm_all_reduce(x)
    dist.all_reduce(x, group=get_tp_group())
    return x


def enable_symm_mem_all_reduce(device: torch.device, dtype: torch.dtype) -> bool:
    """Send small all-reduces of `dtype` on `device` through symmetric memory (`fxrewrite.symm_all_reduce`)
    from now on; True when enabled. Collective over the TP group: every TP rank calls it (the model
    runner does, on CUDA, before capturing CUDA graphs). A no-op returning False at tp_size 1."""
    global _symm_all_reduce
    if get_tp_size() == 1 or _symm_all_reduce is not None:
        return _symm_all_reduce is not None
    _symm_all_reduce = SymmMemAllReduce.create(_state.tp_group, device, dtype)
    return _symm_all_reduce is not None


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The TP ranks' `x` concatenated along `dim`, in rank order: [..., d] -> [..., tp_size * d]."""
    tp_size = get_tp_size()
    if tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x, group=_state.tp_group)
    return torch.cat(parts, dim=dim)


_expert_parallel = False


def set_expert_parallel(enabled: bool) -> None:
    """vLLM's ``enable_expert_parallel``: MoE layers built or sharded afterwards split their experts
    across the TP ranks (whole experts per rank) instead of each expert's columns."""
    global _expert_parallel
    _expert_parallel = bool(enabled)


def expert_parallel_enabled() -> bool:
    return _expert_parallel
