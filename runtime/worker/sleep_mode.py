"""Sleep mode (vLLM's `LLM.sleep` / `wake_up`): give the device memory back between rollouts.

- level 1: the KV cache is freed (its contents are lost) and, on a GPU, the weights are copied to
  pinned host memory and their device memory freed; `wake_up` brings both back.
- level 2: the KV cache and the weights are freed with nothing kept; after `wake_up` the weights hold
  garbage until `load_weights` fills them (the engine refuses requests until then).

Memory is released by resizing each tensor's storage to 0 bytes and restored by resizing it back, so
every tensor object (parameters, the per-layer KV views) stays the same; the restored memory has a new
address, so the decode CUDA graphs (which also hold a memory pool) are dropped at sleep and captured
again at wake-up. The caching allocator's free blocks are returned to the driver (`empty_cache`).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch

from fxrewrite.kernels.batch_invariant import batch_invariant_mode
from fxrewrite.runtime.worker.cuda_graphs import build_graph_runner

TAGS = ("weights", "kv_cache")


@dataclass
class _Freed:
    """A storage whose memory was released: its size, and a host copy when it must come back."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None = None


@dataclass
class SleepState:
    level: int
    asleep: dict[str, list[_Freed]] = field(default_factory=dict)
    """tag -> storages still freed."""
    weights_discarded: bool = False
    """level 2: the weights' memory is back but holds garbage until load_weights."""
    written: dict[int, set] = field(default_factory=dict)
    """While weights_discarded: id(param) -> shard ids written since (strict=False loads add up until all are)."""


def _unique_storages(tensors) -> list[torch.UntypedStorage]:
    seen, out = set(), []
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out.append(storage)
    return out


def _free(storages, keep_host: bool) -> list[_Freed]:
    out = []
    for storage in storages:
        host = None
        if keep_host:
            device_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            host.copy_(device_bytes)
        out.append(_Freed(storage, storage.nbytes(), host))
        storage.resize_(0)
    return out


def _restore(freed: list[_Freed]) -> None:
    for f in freed:
        f.storage.resize_(f.nbytes)
        data = torch.empty(0, dtype=torch.uint8, device=f.storage.device).set_(f.storage)
        if f.host is not None:
            data.copy_(f.host, non_blocking=True)
        else:
            data.zero_()
    if freed and freed[0].storage.device.type == "cuda":
        torch.cuda.synchronize(freed[0].storage.device)


def _release_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_level(level, asleep: SleepState | None = None) -> None:
    """ValueError for a level other than the int 1 or 2, or for a deeper level than the one `asleep` sleeps at
    (level 2 after level 1 would free weights that level 1 kept: wake_up first)."""
    if type(level) is not int or level not in (1, 2):
        raise ValueError(f"sleep level={level!r} must be 1 (free the KV cache, offload the weights) or 2 "
                         "(free both, the weights are reloaded with load_weights)")
    if asleep is not None and level > asleep.level:
        raise ValueError(f"sleep(level={level}): already asleep at level {asleep.level}; call wake_up() first")


def sleep(runner, level: int) -> SleepState:
    """Free the runner's KV cache (and weights, see the module docstring); ValueError from `check_level`."""
    check_level(level)
    state = SleepState(level)
    runner.graph_runner = None  # its graphs point at the memory about to go, and hold their own pool
    state.asleep["kv_cache"] = _free(_unique_storages(k for pair in runner.kv_caches for k in pair), False)
    params = list(runner.model.parameters())
    if level == 2 or runner.device.type == "cuda":  # level 1 on a CPU: the weights are host memory already
        state.asleep["weights"] = _free(_unique_storages(params), keep_host=level == 1)
    _release_device_memory(runner.device)
    return state


def wake_up(runner, state: SleepState, tags: list[str] | None) -> None:
    """Restore the tagged parts ("weights", "kv_cache"; None: both); ValueError for another tag. The
    KV cache comes back zeroed; decode CUDA graphs are captured again once both parts are back."""
    tags = list(TAGS) if tags is None else list(tags)
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise ValueError(f"wake_up tags {bad} are not among {list(TAGS)}")
    for tag in tags:
        freed = state.asleep.pop(tag, None)
        if freed is not None:
            _restore(freed)
            if tag == "weights" and state.level == 2:
                state.weights_discarded = True
    if not state.asleep and runner.graph_runner is None:
        with batch_invariant_mode(runner.config.batch_invariant):
            runner.graph_runner = build_graph_runner(runner.model, runner.kv_caches, runner.config,
                                                     runner.model_config, runner.device)


def storage_bytes(tensors) -> int:
    """Bytes the tensors' distinct storages hold now (0 for a freed one)."""
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        key = id(storage) if storage.data_ptr() == 0 else storage.data_ptr()
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def memory_held(runner) -> dict[str, int]:
    """Bytes the runner's KV cache and weights hold now (what a sleep released reads 0)."""
    return {"kv_cache": storage_bytes(k for pair in runner.kv_caches for k in pair),
            "weights": storage_bytes(runner.model.parameters())}


def rank_label(report: dict) -> str:
    """"rank 2 (PP stage 1, TP rank 0)" for a worker's report (`Worker.control`)."""
    return f"rank {report['rank']} (PP stage {report['stage']}, TP rank {report['tp_rank']})"


def _describe(status) -> str:
    if status is None:
        return "awake"
    asleep, discarded = status
    parts = [f"asleep ({', '.join(asleep)} freed)"] if asleep else []
    return " and ".join(parts + (["weights discarded, awaiting load_weights"] if discarded else []))


def combine_rank_statuses(reports: list[dict]):
    """The engine's sleep status (as `ModelRunner.sleep_status`) from every worker rank's report: the common
    status when all ranks agree (asleep only when every rank is), else RuntimeError naming the ranks of
    each status. None for no reports."""
    groups: dict = {}
    for r in reports:
        status = r["sleep"]
        key = None if status is None else (tuple(sorted(status[0])), bool(status[1]))
        groups.setdefault(key, []).append(rank_label(r))
    if len(groups) <= 1:
        return next(iter(groups), None)
    states = "; ".join(f"{_describe(s)} on {', '.join(labels)}" for s, labels in groups.items())
    raise RuntimeError(f"sleep mode: the worker ranks disagree ({states}); call wake_up() (or sleep()) again "
                       "to bring every rank to one state, or restart the engine")
