"""Driver side of data parallelism: dp_size x tp_size worker processes, one model runner view per replica.

`DPExecutor` starts the workers (`fxrewrite.runtime.worker.dp_worker`), each replica d a tensor-parallel
group of its own with its own KV cache. `replica(d)` is what replica d's `LLMEngine` uses as its model
runner: its `execute_model_async` adds the step to the current *wave* and returns a `DPStep`. `flush()`
broadcasts the wave (every replica's step, None where it scheduled nothing) to every worker; the data-
parallel front (`fxrewrite.runtime.engine.data_parallel.DPLLMEngine`) flushes once per engine step,
after every replica has scheduled, so the replicas (and, under DP x EP, their shared MoE layers) run
their steps together. A step's `result()` flushes its wave first if it is still open (synchronous
use), then receives every replica's tokens of the waves up to it, in wave order.

Failures are handled as in `fxrewrite.runtime.worker.executor.MultiprocExecutor`: every wait polls the
worker processes; a dead worker ends the call with WorkerError and the others are stopped.
"""

from __future__ import annotations

import collections
import copy
import datetime
import logging
import multiprocessing.connection
import os
import time
import weakref

import torch
import torch.distributed as dist

from fxrewrite import data_parallel, distributed
from fxrewrite.runtime.worker.dp_worker import dp_worker_main
from fxrewrite.runtime.worker.executor import RemoteModel
from fxrewrite.runtime.worker.worker_processes import (
    STARTUP_TIMEOUT_S, WorkerError, WorkerGuard, _failure, _Processes, check_not_bootstrapping, spawn_workers)
from fxrewrite.runtime.worker.step_messages import StepEncoder, attach_bitmask
from fxrewrite.runtime.worker.worker import broadcast_object, split_step_result

logger = logging.getLogger(__name__)


class DPExecutor(WorkerGuard):
    """dp_size replicas of tensor_parallel_size workers. Attributes: num_blocks (per replica), model."""

    def __init__(self, config, model_config, eos_token_ids: set[int]):
        check_not_bootstrapping()  # before anything is made that an exiting worker would leave behind
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process: one "
                               "multi-process engine per process (shut the other one down first)")
        self.dp_size, self.tp_size = config.data_parallel_size, config.tensor_parallel_size
        self.num_workers = self.dp_size * self.tp_size
        self._procs = _Processes("data-parallel",
                                 f"process i is DP rank i // {self.tp_size}, TP rank i % {self.tp_size}")
        # The stop wave: workers leave their loop at a None wave (else they wait until killed at the timeout)
        self._procs.send_stop = lambda wait: broadcast_object(None, 0, wait=wait)
        self._finalizer = weakref.finalize(self, self._procs.close, True)
        self._dead: str | None = None
        self._encoders = [StepEncoder() for _ in range(self.dp_size)]
        self._wave: list = [None] * self.dp_size
        self._wave_steps: list[DPStep | None] = [None] * self.dp_size
        self._outstanding: collections.deque[list] = collections.deque()
        try:
            self._start(config, model_config, eos_token_ids, distributed.default_backend(config.device))
        except BaseException:
            self._procs.close(graceful=False)
            raise

    def _start(self, config, model_config, eos_token_ids, backend: str) -> None:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        store = dist.TCPStore(host, int(os.environ.get("MASTER_PORT", 0)), self.num_workers + 1, is_master=True,
                              wait_for_workers=False, timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        self._procs.store = store
        config = copy.copy(config)
        config.hf_overrides = None  # resolved into model_config; a callable would not pickle
        if config.enable_expert_parallel:
            # The MoE layers' cross-replica collectives are not traced by torch.compile. Decode waves
            # still run in CUDA graphs, every replica at one bucket (dp_worker.wave_bucket).
            config.compilation_config = 0
        self._procs.context = spawn_workers(
            dp_worker_main, (config, model_config, eos_token_ids, host, store.port, self.dp_size, self.tp_size,
                             os.getpid()), self.num_workers)
        self._wait_ready(store)
        _, self._results = data_parallel.initialize(0, store, self.dp_size, self.tp_size, backend,
                                                    config.enable_expert_parallel)
        self._procs.joined_group = True
        wait = self._wait("model loading", STARTUP_TIMEOUT_S)
        infos = [broadcast_object(None, leader, group, wait=wait) for leader, group in self._results]
        self.num_blocks = [info["num_blocks"] for info in infos]
        self.model = RemoteModel(infos[0]["impl"], infos[0]["cuda_graph_buckets"], infos[0]["compiled"])

    def _wait_ready(self, store) -> None:
        keys = [f"fxrewrite/worker_ready/{r}" for r in range(1, self.num_workers + 1)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not store.check(keys):
            if multiprocessing.connection.wait(list(self._procs.context.sentinels), timeout=0.05):
                raise _failure(self._procs, "startup")
            if time.monotonic() > deadline:
                raise WorkerError(f"data-parallel workers did not start within {STARTUP_TIMEOUT_S:.0f} s")

    def replica(self, dp_rank: int) -> DPReplicaRunner:
        return DPReplicaRunner(self, dp_rank)

    def submit(self, dp_rank: int, sched, bitmask_hook=None) -> DPStep:
        """Add replica `dp_rank`'s step to the open wave (flushing the wave first if it already has one);
        `bitmask_hook`: its grammar mask goes with the step (`attach_bitmask`)."""
        self.check_health()
        if self._wave_steps[dp_rank] is not None:
            self.flush()
        msg = self._encoders[dp_rank].encode(sched)
        attach_bitmask(msg, sched, bitmask_hook)  # may complete (receive) the replica's step in flight first
        step = DPStep(self, sched)
        self._wave[dp_rank] = msg
        self._wave_steps[dp_rank] = step
        return step

    def flush(self) -> None:
        """Send the open wave to every worker (nothing when no replica has a step in it)."""
        if all(s is None for s in self._wave_steps):
            return
        wave, steps = self._wave, self._wave_steps
        self._wave, self._wave_steps = [None] * self.dp_size, [None] * self.dp_size
        with self._exchange():
            self._guard(lambda: broadcast_object(wave, 0, wait=self._wait("the step broadcast")))
            self._outstanding.append(steps)
            for step in steps:
                if step is not None:
                    step._sent = True

    def receive(self, step: DPStep) -> None:
        """Receive every replica's tokens of the waves sent, in order, until `step`'s are in."""
        if not step._sent:
            self.flush()
        with self._exchange():
            while step._out is None:
                self.check_health()
                steps = self._outstanding.popleft()
                wait = self._wait("a model step")
                for (leader, group), s in zip(self._results, steps):
                    out = self._guard(lambda: broadcast_object(None, leader, group, wait=wait))
                    if s is not None:
                        s._out, s.prompt_logprobs = split_step_result(out)

    def check_health(self) -> None:
        """WorkerError once a worker has failed or the workers were shut down."""
        if self._dead is not None:
            raise WorkerError(f"the data-parallel workers are shut down ({self._dead})")

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers (idempotent); graceful receives the steps in flight first."""
        if self._dead is None and graceful and self._outstanding:
            try:
                last = next(s for s in reversed(self._outstanding[-1]) if s is not None)
                self.receive(last)
            except Exception as e:  # noqa: BLE001 - shutting down anyway
                logger.debug("tokens of the steps in flight not received: %s", e)
                graceful = False
        if self._dead is None:
            self._dead = "shut down by the driver"
        if self._finalizer.detach() is not None:
            self._procs.close(graceful)
            data_parallel.reset()

    def worker_pids(self) -> list[int]:
        ctx = self._procs.context
        return [p.pid for p in ctx.processes] if ctx is not None else []


class DPStep:
    """A replica's step in a wave; `result()` -> (driver Sequences that sampled, their SampleResults)."""

    def __init__(self, executor: DPExecutor, sched):
        self.sched = sched
        self._executor = executor
        self._seqs = {s.seq.seq_id: s.seq for s in sched.scheduled}
        self._sent = False
        self._out: list | None = None
        self.prompt_logprobs: list | None = None
        """The step's `PromptLogprobsChunk`s (with `result()`), as `PendingStep`'s."""

    def result(self):
        if self._out is None:
            self._executor.receive(self)
        return [self._seqs[seq_id] for seq_id, _ in self._out], [r for _, r in self._out]

    def token_ids(self) -> tuple[list, list[int]]:
        """(driver Sequences that sampled, their token ids): what the grammar process accepts."""
        seqs, results = self.result()
        return seqs, [r.token_id for r in results]


class DPReplicaRunner:
    """Replica d's model runner as its `LLMEngine` sees it (the weights live in the workers)."""

    supports_async = True
    device = torch.device("cpu")
    """Where the driver's side of a step lives (a grammar mask is filled here, then sent with the step)."""

    def __init__(self, executor: DPExecutor, dp_rank: int):
        self.executor, self.dp_rank = executor, dp_rank
        self.num_blocks = executor.num_blocks[dp_rank]
        self.model = executor.model

    def execute_model_async(self, sched, previous=None, bitmask_hook=None) -> DPStep:
        """`previous` is not needed: each worker feeds tokens still in flight from its own last step."""
        return self.executor.submit(self.dp_rank, sched, bitmask_hook)

    def execute_model(self, sched):
        return self.execute_model_async(sched).result()

    def check_health(self) -> None:
        self.executor.check_health()

    def sleep_status(self):
        return None

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("weight sync and sleep mode are not supported with data_parallel_size > 1")

    load_weights = sleep = wake_up = _unsupported
