"""Runs the model on N tensor-parallel worker processes; the driver (this process) only schedules.

`create_model_runner(config, model_config, eos_token_ids)` is what `LLMEngine` calls:
- tensor_parallel_size 1: the in-process `ModelRunner`;
- this process already a TP rank of that size (``torchrun`` + `fxrewrite.distributed.init_from_env`,
  SPMD: every rank runs the same engine and schedules identically): a `ModelRunner` on this rank's shard;
- else `MultiprocExecutor`: N workers started with `torch.multiprocessing` (spawn), joined through a
  `torch.distributed.TCPStore` (MASTER_ADDR / MASTER_PORT when set, else a free local port).

Failure handling: every wait on a worker polls the workers' process sentinels, so a worker that
dies (or raises) ends the step with a RuntimeError carrying its exit status or traceback, and the
others are terminated (then killed); Ctrl-C in the driver shuts the workers down the same way
(they ignore SIGINT themselves). Workers exit on their own when the driver disappears. A normal
exit (`shutdown`, garbage collection or interpreter exit) sends them ``None`` and joins them.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import logging
import multiprocessing.connection
import os
import threading
import time
import weakref

import torch
import torch.distributed as dist

from fxrewrite import distributed
from fxrewrite.runtime.worker import NewSeq, SeqStep, StepMessage, broadcast_object, worker_main

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 1800.0
"""Workers must have built their model shards within this (large checkpoints load slowly)."""
STEP_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 10.0


def create_model_runner(config, model_config, eos_token_ids: set[int]):
    """ModelRunner or MultiprocExecutor (see the module docstring); both have `execute_model`, `num_blocks`."""
    from fxrewrite.runtime.model_runner import ModelRunner
    from fxrewrite.runtime.worker import rank_model_config

    tp_size = config.tensor_parallel_size
    if tp_size == 1:
        return ModelRunner(config, model_config, eos_token_ids)
    _check_tp_divisible(model_config, tp_size, config)
    state = distributed.get_state()
    if state is not None and state.tp_group is not None and state.tp_size == tp_size:
        runner = ModelRunner(config, rank_model_config(model_config, tp_size), eos_token_ids)
        # Every rank schedules on its own: they must agree on the KV cache size to stay in step.
        num_blocks = torch.tensor([runner.num_blocks], dtype=torch.int64, device=runner.device)  # NCCL: on the GPU
        dist.all_reduce(num_blocks, op=dist.ReduceOp.MIN, group=state.tp_group)
        runner.num_blocks = int(num_blocks)
        return runner
    return MultiprocExecutor(config, model_config, eos_token_ids)


def _check_tp_divisible(model_config, tp_size: int, config) -> None:
    """Refuse a tensor_parallel_size that does not divide the heads / MLP width, before any worker starts."""
    text = model_config.hf_text_config
    checks = [("num_attention_heads", model_config.num_attention_heads),
              ("intermediate_size", getattr(text, "intermediate_size", None))]
    if getattr(config, "fusion", True) is False:
        checks.append(("num_key_value_heads", model_config.num_key_value_heads))
    for name, value in checks:
        if isinstance(value, int) and value % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} must divide the model's {name}={value}")


@dataclasses.dataclass
class RemoteModel:
    """What the driver knows of the workers' model (its weights live in the workers)."""

    impl: str | None


class _Processes:
    """The spawn context and store; `close` is the finalizer (no reference to the executor)."""

    def __init__(self) -> None:
        self.context = None
        self.store = None
        self.joined_group = False
        # The server steps in a worker thread; the exit-time shutdown must not interleave with a step.
        self.lock = threading.RLock()

    def close(self, graceful: bool) -> None:
        with self.lock:
            self._close(graceful)

    def _close(self, graceful: bool) -> None:
        if graceful and self.joined_group and self.context is not None and self.context.sentinels:
            try:
                broadcast_object(None, 0, wait=lambda w: _poll(w, self, SHUTDOWN_TIMEOUT_S, "shutdown"))
            except Exception as e:  # noqa: BLE001 - a dead worker must not stop the shutdown
                logger.debug("shutdown message not delivered: %s", e)
        if self.context is not None:
            _stop_processes(self.context.processes, SHUTDOWN_TIMEOUT_S if graceful else 0.0)
            self.context = None
        if self.joined_group:
            distributed.destroy()
            self.joined_group = False
        self.store = None


def _stop_processes(processes, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join()


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed; the engine is shut down."""


def _poll(work, procs: _Processes, timeout: float, what: str) -> None:
    """Wait for a torch.distributed work item while watching the worker processes."""
    start, delay = time.monotonic(), 1e-4
    sentinels = list(procs.context.sentinels) if procs.context is not None else []
    while not work.is_completed():
        if sentinels and multiprocessing.connection.wait(sentinels, timeout=delay):
            raise _failure(procs, what)
        if time.monotonic() - start > timeout:
            raise WorkerError(f"tensor-parallel workers did not answer within {timeout:.0f} s ({what})")
        delay = min(delay * 2, 1e-3)  # at most 1 ms late: a GPU decode step takes a few ms
    try:
        work.wait()
    except RuntimeError as e:  # gloo reports a dead peer as a closed connection
        raise _failure(procs, what, e) from e


def _failure(procs: _Processes, what: str, cause: BaseException | None = None) -> WorkerError:
    """The first failed worker's story (exit code / signal / traceback, from torch's spawn context)."""
    from torch.multiprocessing.spawn import ProcessException

    detail = str(cause) if cause is not None else "a worker process exited"
    if procs.context is None:
        return WorkerError(f"tensor-parallel worker failed during {what}: {detail}")
    pids = [p.pid for p in procs.context.processes]
    try:
        procs.context.join(timeout=5.0, grace_period=1.0)
    except ProcessException as e:
        detail = str(e).strip()
    except Exception as e:  # noqa: BLE001
        detail = f"{detail}; {e}"
    return WorkerError(f"tensor-parallel worker failed during {what} (process i is TP rank i; pids {pids}): {detail}")


class MultiprocExecutor:
    """Driver side of tensor parallelism: `execute_model(sched) -> (seqs, results)` like `ModelRunner`.

    Attributes: num_blocks (the smallest KV block count over the ranks), model (`RemoteModel`).
    After a failure every call raises WorkerError.
    """

    def __init__(self, config, model_config, eos_token_ids: set[int]):
        tp_size = config.tensor_parallel_size
        backend = distributed.default_backend(config.device)
        if backend == "nccl" and torch.cuda.device_count() < tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} needs {tp_size} GPUs, found {torch.cuda.device_count()}")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process: one "
                               "tensor-parallel engine per process (shut the other one down first)")
        self.tp_size = tp_size
        self._procs = _Processes()
        self._finalizer = weakref.finalize(self, self._procs.close, True)
        self._dead: str | None = None
        self._seqs: dict[int, object] = {}
        self._sent: dict[int, int] = {}
        try:
            self._start(config, model_config, eos_token_ids, backend)
        except BaseException:
            self._procs.close(graceful=False)
            raise

    def _start(self, config, model_config, eos_token_ids, backend: str) -> None:
        import torch.multiprocessing as mp

        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT", 0))
        store = dist.TCPStore(host, port, self.tp_size + 1, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        self._procs.store = store
        # The workers get the resolved model_config; a callable hf_overrides would not pickle.
        config = copy.copy(config)
        config.hf_overrides = None
        self._procs.context = mp.start_processes(
            worker_main, args=(config, model_config, eos_token_ids, host, store.port, self.tp_size, os.getpid()),
            nprocs=self.tp_size, join=False, start_method="spawn",
        )
        self._wait_ready(store)
        distributed.initialize(0, self.tp_size + 1, store=store, tp_ranks=list(range(1, self.tp_size + 1)),
                               with_driver=True, tp_backend=backend)
        self._procs.joined_group = True
        info = broadcast_object(None, 1, distributed.get_state().driver_group,
                                wait=lambda w: _poll(w, self._procs, STARTUP_TIMEOUT_S, "model loading"))
        self.num_blocks = info["num_blocks"]
        self.model = RemoteModel(info["impl"])

    def _wait_ready(self, store) -> None:
        """Poll the store until every worker is about to join the group, watching their processes."""
        keys = [f"fxrewrite/worker_ready/{r}" for r in range(1, self.tp_size + 1)]
        sentinels = list(self._procs.context.sentinels)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not store.check(keys):
            if multiprocessing.connection.wait(sentinels, timeout=0.05):
                raise _failure(self._procs, "startup")
            if time.monotonic() > deadline:
                raise WorkerError(f"tensor-parallel workers did not start within {STARTUP_TIMEOUT_S:.0f} s")

    def execute_model(self, sched):
        """Ship the step to the workers; returns (driver Sequences that sampled, their SampleResults)."""
        if self._dead is not None:
            raise WorkerError(f"the tensor-parallel workers are shut down ({self._dead})")
        msg = self._encode(sched)
        wait = lambda what: lambda w: _poll(w, self._procs, STEP_TIMEOUT_S, what)  # noqa: E731
        with self._procs.lock:
            try:
                broadcast_object(msg, 0, wait=wait("the step broadcast"))
                out = broadcast_object(None, 1, distributed.get_state().driver_group, wait=wait("a model step"))
            except BaseException as e:
                self._dead = f"{type(e).__name__}: {e}"
                self.shutdown(graceful=False)
                raise
        return [self._seqs[seq_id] for seq_id, _ in out], [result for _, result in out]

    def _encode(self, sched) -> StepMessage:
        finished = [sid for sid, seq in self._seqs.items() if seq.is_finished]
        for sid in finished:
            del self._seqs[sid], self._sent[sid]
        new, steps = [], []
        for s in sched.scheduled:
            seq = s.seq
            if seq.seq_id not in self._seqs:
                new.append(NewSeq(seq.seq_id, seq.request_id, seq.index, seq.prompt_token_ids, seq.sampling_params))
                self._seqs[seq.seq_id], self._sent[seq.seq_id] = seq, seq.num_prompt_tokens
            delta = seq.token_ids[self._sent[seq.seq_id]:]
            self._sent[seq.seq_id] = len(seq.token_ids)
            steps.append(SeqStep(seq.seq_id, delta, list(seq.block_table), s.start, s.num_new_tokens))
        return StepMessage(new, steps, finished)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers (idempotent): graceful sends them None and joins; else terminate/kill."""
        if self._dead is None:
            self._dead = "shut down by the driver"
        if self._finalizer.detach() is not None:
            self._procs.close(graceful)

    def worker_pids(self) -> list[int]:
        ctx = self._procs.context
        return [p.pid for p in ctx.processes] if ctx is not None else []
