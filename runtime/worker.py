"""A tensor-parallel worker process: one per rank; holds its model shard and its KV heads, runs steps.

Protocol (all over `torch.distributed`, see `fxrewrite.distributed`): world rank 0 is the driver
(`fxrewrite.runtime.executor`), ranks 1..N the workers. Each step the driver broadcasts a
`StepMessage` on the default (gloo) group; every worker applies it to its `SequenceMirror`, runs
`ModelRunner.execute_model` (the model's collectives run on the TP group), and TP rank 0 sends
``[(seq_id, SampleResult), ...]`` back on the (driver, rank 0) group. ``None`` means shut down.
Sampling state lives in the workers' mirrors: a seeded request's generator advances there only,
exactly as it would in a single-process engine, and every rank samples the same gathered logits.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from fxrewrite import distributed
from fxrewrite.runtime.scheduler import ScheduledSeq, SchedulerOutput
from fxrewrite.runtime.sequence import Sequence


@dataclasses.dataclass
class NewSeq:
    """A sequence the workers have not seen: enough to rebuild it (and its seeded generator)."""

    seq_id: int
    request_id: str
    index: int
    prompt_token_ids: list[int]
    sampling_params: object


@dataclasses.dataclass
class SeqStep:
    """One scheduled sequence: tokens appended since the last message, its block table, the chunk."""

    seq_id: int
    new_token_ids: list[int]
    block_table: list[int]
    start: int
    num_new_tokens: int


@dataclasses.dataclass
class StepMessage:
    new: list[NewSeq]
    steps: list[SeqStep]
    finished: list[int]
    """seq ids the driver has finished or aborted: the mirrors drop them."""


class SequenceMirror:
    """The workers' copy of the driver's running sequences, kept in step by `StepMessage`s."""

    def __init__(self) -> None:
        self.seqs: dict[int, Sequence] = {}

    def apply(self, msg: StepMessage) -> SchedulerOutput:
        for fid in msg.finished:
            self.seqs.pop(fid, None)
        for n in msg.new:
            seq = Sequence(n.request_id, n.prompt_token_ids, n.sampling_params, n.index)
            seq.seq_id = n.seq_id
            self.seqs[n.seq_id] = seq
        out = SchedulerOutput()
        for st in msg.steps:
            seq = self.seqs[st.seq_id]
            seq.token_ids.extend(st.new_token_ids)
            seq.block_table = st.block_table
            seq.num_computed_tokens = st.start
            out.scheduled.append(ScheduledSeq(seq, st.num_new_tokens))
        return out


def rank_model_config(model_config, tp_size: int):
    """A copy whose num_key_value_heads is the per-rank count (what the KV cache holds): total / tp,
    or 1 when kv heads are replicated (fewer kv heads than ranks)."""
    kv = model_config.num_key_value_heads
    return dataclasses.replace(model_config, num_key_value_heads=max(1, kv // tp_size))


def broadcast_object(obj, src: int, group=None, wait=None):
    """Pickled `obj` from global rank `src` to the group; returns it on every rank.

    Two broadcasts (size, bytes). `wait(work)` (the driver's, which watches the worker processes)
    replaces the blocking `work.wait()` when given.
    """
    is_src = dist.get_rank() == src
    payload = pickle.dumps(obj) if is_src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    _run(dist.broadcast(size, src, group=group, async_op=True), wait)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if is_src else torch.empty(int(size), dtype=torch.uint8)
    _run(dist.broadcast(data, src, group=group, async_op=True), wait)
    return obj if is_src else pickle.loads(data.numpy().tobytes())


def _run(work, wait) -> None:
    if wait is None:
        work.wait()
    else:
        wait(work)


class Worker:
    """Builds the rank's `ModelRunner` (model shard, KV cache of its heads) and runs steps."""

    def __init__(self, config, model_config, eos_token_ids: set[int]):
        from fxrewrite.runtime.model_runner import ModelRunner

        tp_size = distributed.get_tp_size()
        self.runner = ModelRunner(config, rank_model_config(model_config, tp_size), eos_token_ids)
        self.mirror = SequenceMirror()

    def num_blocks(self) -> int:
        """The smallest KV block count over the TP ranks (what the driver's block manager may use)."""
        # On the runner's device: the TP group is NCCL on GPUs, and NCCL has no CPU tensors.
        n = torch.tensor([self.runner.num_blocks], dtype=torch.int64, device=self.runner.device)
        dist.all_reduce(n, op=dist.ReduceOp.MIN, group=distributed.get_tp_group())
        return int(n)

    def execute(self, msg: StepMessage) -> list[tuple[int, object]]:
        sched = self.mirror.apply(msg)
        if sched.is_empty():
            return []
        seqs, results = self.runner.execute_model(sched)
        return [(seq.seq_id, result) for seq, result in zip(seqs, results)]


def _watch_parent(parent_pid: int) -> None:
    """Exit when the driver is gone (killed with no chance to shut us down)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def worker_main(local_rank: int, config, model_config, eos_token_ids: set[int], host: str, port: int,
                tp_size: int, parent_pid: int) -> None:
    """torch.multiprocessing entry point of TP rank `local_rank` (global rank local_rank + 1)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's: it shuts us down
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    backend = distributed.default_backend(config.device)
    config = copy.copy(config)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        config.device = f"cuda:{local_rank}"
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp_size))
        config.device = config.device or "cpu"
    rank = local_rank + 1
    store = dist.TCPStore(host, port, tp_size + 1, is_master=False, timeout=distributed.TP_TIMEOUT)
    store.set(f"fxrewrite/worker_ready/{rank}", "1")
    state = distributed.initialize(rank, tp_size + 1, store=store, tp_ranks=list(range(1, tp_size + 1)),
                                   with_driver=True, tp_backend=backend)
    worker = Worker(config, model_config, eos_token_ids)
    num_blocks = worker.num_blocks()
    if state.tp_rank == 0:
        broadcast_object({"num_blocks": num_blocks, "impl": getattr(worker.runner.model, "impl", None)},
                         1, state.driver_group)
    while (msg := broadcast_object(None, 0)) is not None:
        out = worker.execute(msg)
        if state.tp_rank == 0:
            broadcast_object(out, 1, state.driver_group)
    # Normal shutdown: exit without destroying the process groups (NCCL's destroy_process_group blocks
    # on an H200 pair until the driver kills us; the exit frees everything) or the interpreter's slow
    # teardown (nothing is left to flush but stdio).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
