"""Runs the model on N tensor-parallel worker processes; the driver (this process) only schedules.

`create_model_runner(config, model_config, eos_token_ids)` is what `LLMEngine` calls:
- tensor_parallel_size 1: the in-process `ModelRunner`;
- this process already a TP rank of that size (``torchrun`` + `fxrewrite.distributed.init_from_env`,
  SPMD: every rank runs the same engine and schedules identically): a `ModelRunner` on this rank's shard;
- else `MultiprocExecutor`: N workers started with `torch.multiprocessing` (spawn), joined through a
  `torch.distributed.TCPStore` (MASTER_ADDR / MASTER_PORT when set, else a free local port).

Steps are asynchronous like the single-process runner's: `execute_model_async` sends the step and
returns a `RemoteStep`; its `result()` receives the tokens, which TP rank 0 sends in step order, so the
engine schedules step n+1 while the workers run step n. A message carries only what changed (new
tokens, new block ids; `fxrewrite.runtime.worker.worker.StepEncoder`). Steps and tokens go through
shared memory when every worker can attach to it, else gloo (`fxrewrite.runtime.worker.step_channel`).

Failures: every wait polls the workers' sentinels; a worker that dies (or raises) ends the step with a
WorkerError carrying its exit status or traceback and the others are stopped, as on Ctrl-C (workers
ignore SIGINT, and exit when the driver disappears). `shutdown`, GC or exit sends ``None`` and joins."""

from __future__ import annotations

import collections
import copy
import dataclasses
import datetime
import logging
import multiprocessing.connection
import os
import time
import weakref

import torch
import torch.distributed as dist

from fxrewrite.errors import UserInputError
from fxrewrite import distributed
from fxrewrite.runtime.model_files.dense_mlp import dense_mlp_width
from fxrewrite.runtime.worker.cpu_threads import size_cpu_threads
from fxrewrite.runtime.worker.model_runner import ModelRunner
from fxrewrite.runtime.worker.moe_checks import check_moe_parallel
from fxrewrite.runtime.worker.step_channel import GlooChannel, driver_shm_channel, settle_driver_channel
from fxrewrite.runtime.worker.step_messages import StepEncoder, attach_bitmask
from fxrewrite.runtime.worker.worker import (ControlMessage, broadcast_object, rank_model_config, split_step_result,
                                             worker_main)
from fxrewrite.runtime.worker.pipeline import check_pipeline_size, layer_partition
from fxrewrite.runtime.worker.sleep_mode import combine_rank_statuses
from fxrewrite.runtime.worker.worker_processes import (  # noqa: F401  (WorkerError: re-exported)
    STARTUP_TIMEOUT_S, STEP_TIMEOUT_S, WorkerError, WorkerGuard, _check_workers, _failure, _poll, _Processes,
    check_not_bootstrapping, spawn_workers)

logger = logging.getLogger(__name__)

def create_model_runner(config, model_config, eos_token_ids: set[int]):
    """ModelRunner or MultiprocExecutor (see the module docstring); both have `execute_model`, `num_blocks`."""
    tp_size, pp_size = config.tensor_parallel_size, getattr(config, "pipeline_parallel_size", 1)
    check_moe_parallel(model_config, config)
    if pp_size > 1:  # before any worker starts
        check_pipeline_size(model_config.num_hidden_layers, pp_size)
        layer_partition(model_config.num_hidden_layers, pp_size)  # a bad VLLM_PP_LAYER_PARTITION fails here
    if tp_size == 1 and pp_size == 1:
        if torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cpu":
            size_cpu_threads(1)  # the workers' rule, for the model in this process
        return ModelRunner(config, model_config, eos_token_ids)
    check_tp_divisible(model_config, tp_size, config)
    if pp_size > 1:
        return MultiprocExecutor(config, model_config, eos_token_ids)
    state = distributed.get_state()
    if state is not None and state.tp_group is not None and state.tp_size == tp_size:
        runner = ModelRunner(config, rank_model_config(model_config, tp_size), eos_token_ids)
        # Every rank schedules on its own: they must agree on the KV cache size to stay in step.
        num_blocks = torch.tensor([runner.num_blocks], dtype=torch.int64, device=runner.device)  # NCCL: on the GPU
        dist.all_reduce(num_blocks, op=dist.ReduceOp.MIN, group=state.tp_group)
        runner.num_blocks = int(num_blocks)
        return runner
    return MultiprocExecutor(config, model_config, eos_token_ids)


def check_tp_divisible(model_config, tp_size: int, config) -> None:
    """Refuse a tensor_parallel_size that does not divide the heads / dense MLP width (`dense_mlp_width`), before
    any worker starts."""
    text = model_config.hf_text_config
    checks = [("num_attention_heads", model_config.num_attention_heads),
              ("intermediate_size", dense_mlp_width(text))]
    if getattr(config, "fusion", True) is False:
        checks.append(("num_key_value_heads", model_config.num_key_value_heads))
    for name, value in checks:
        if isinstance(value, int) and value % tp_size:
            raise UserInputError(f"tensor_parallel_size={tp_size} must divide the model's {name}={value}")


def _worker_roles(tp_size: int, pp_size: int) -> tuple[str, str]:
    """(what the workers are, which rank each process is) for WorkerError messages: process i is pipeline stage
    i // tp_size, TP rank i % tp_size of it (`worker.worker_main`)."""
    if pp_size == 1:
        return "tensor-parallel", "process i is TP rank i"
    if tp_size == 1:
        return "pipeline-parallel", "process i is PP stage i"
    return "tensor/pipeline-parallel", f"process i is PP stage i // {tp_size}, TP rank i % {tp_size}"


@dataclasses.dataclass
class RemoteModel:
    """What the driver knows of the workers' model (its weights live in the workers)."""

    impl: str | None
    cuda_graph_buckets: int = 0
    """Decode batch sizes with a captured CUDA graph on the workers."""
    _fxrewrite_compiled: bool = False


class MultiprocExecutor(WorkerGuard):
    """Driver side of tensor parallelism: `execute_model(sched) -> (seqs, results)` like `ModelRunner`.

    Attributes: num_blocks (the smallest KV block count over the ranks), model (`RemoteModel`).
    After a failure every call raises WorkerError.
    """

    device = torch.device("cpu")
    """Where the driver's side of a step lives (a grammar mask is filled here, then sent with the step)."""

    def __init__(self, config, model_config, eos_token_ids: set[int]):
        check_not_bootstrapping()  # before the step queues' shared memory is made (an exiting worker would leak it)
        tp_size, pp_size = config.tensor_parallel_size, getattr(config, "pipeline_parallel_size", 1)
        backend = distributed.default_backend(config.device)
        if backend == "nccl" and torch.cuda.device_count() < tp_size * pp_size:
            raise UserInputError(f"tensor_parallel_size={tp_size} x pipeline_parallel_size={pp_size} needs "
                                 f"{tp_size * pp_size} GPUs, found {torch.cuda.device_count()}")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process: one "
                               "tensor-parallel engine per process (shut the other one down first)")
        self.tp_size, self.num_workers = tp_size, tp_size * pp_size
        if pp_size > 1:
            # No async scheduling (the first stage would need the tokens the last stage is still sampling);
            # instead up to pp_size batches of other sequences are in flight (engine/micro_batches.py).
            self.supports_async = False
            self.pipeline_depth = pp_size
        self._procs = _Processes(*_worker_roles(tp_size, pp_size))
        self._finalizer = weakref.finalize(self, self._procs.close, True)
        self._dead: str | None = None
        self._encoder = StepEncoder()
        self._outstanding: collections.deque[RemoteStep] = collections.deque()
        self._ranks: list[dict] = []
        """Every worker's report in the last control reply (`Worker.control`)."""
        try:
            self._start(config, model_config, eos_token_ids, backend)
        except BaseException:
            self._procs.close(graceful=False)
            raise

    def _start(self, config, model_config, eos_token_ids, backend: str) -> None:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT", 0))
        store = dist.TCPStore(host, port, self.num_workers + 1, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        self._procs.store = store
        # The workers get the resolved model_config; a callable hf_overrides would not pickle.
        config = copy.copy(config)
        config.hf_overrides = None
        procs = self._procs  # not self: the finalizer holds `procs`, which must not reach the executor
        alive = lambda: _check_workers(procs)  # noqa: E731
        shm = self._procs.channel = driver_shm_channel(self.num_workers, alive, STEP_TIMEOUT_S)
        self._procs.context = spawn_workers(
            worker_main, (config, model_config, eos_token_ids, host, store.port, self.tp_size, os.getpid(),
                          shm.handles() if shm is not None else None), self.num_workers)
        self._wait_ready(store)
        self._procs.channel = settle_driver_channel(store, shm, self.num_workers)
        distributed.initialize(0, self.num_workers + 1, store=store, tp_ranks=list(range(1, self.num_workers + 1)),
                               with_driver=True, tp_backend=backend, pp_size=self.num_workers // self.tp_size)
        self._procs.joined_group = True
        state = distributed.get_state()
        if self._procs.channel is None:
            self._procs.channel = GlooChannel(state.results_rank, state.driver_group)
        info = broadcast_object(None, state.results_rank, state.driver_group,
                                wait=lambda w: _poll(w, self._procs, STARTUP_TIMEOUT_S, "model loading"))
        self.num_blocks = info["num_blocks"]
        self.model = RemoteModel(info["impl"], info["cuda_graph_buckets"], info["compiled"])

    @property
    def step_transport(self) -> str:  # "shm" or "gloo" (`fxrewrite.runtime.worker.step_channel`)
        return self._procs.channel.kind

    def _wait_ready(self, store) -> None:
        """Poll the store until every worker is about to join the group, watching their processes."""
        keys = [f"fxrewrite/worker_ready/{r}" for r in range(1, self.num_workers + 1)]
        sentinels = list(self._procs.context.sentinels)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not store.check(keys):
            if multiprocessing.connection.wait(sentinels, timeout=0.05):
                raise _failure(self._procs, "startup")
            if time.monotonic() > deadline:
                raise WorkerError(f"{self._procs.role} workers did not start within {STARTUP_TIMEOUT_S:.0f} s")

    supports_async = True
    """A step's tokens are received after the next step is sent (LLMEngine's async scheduling)."""

    def execute_model(self, sched):
        """Run the step on the workers; returns (driver Sequences that sampled, their SampleResults)."""
        return self.execute_model_async(sched).result()

    def execute_model_async(self, sched, previous=None, bitmask_hook=None) -> RemoteStep:
        """Send the step to the workers and return without waiting. `previous` is not needed: each
        worker feeds tokens still in flight from its own last step. `bitmask_hook`: as `ModelRunner`'s, called
        here before the send (structured outputs: the mask goes with the step, `attach_bitmask`)."""
        self._check_alive()
        msg = self._encoder.encode(sched)
        attach_bitmask(msg, sched, bitmask_hook)
        step = RemoteStep(self, sched)
        with self._exchange():
            self._check_alive()  # again: `check_health` (another thread) may have shut the workers down meanwhile
            self._guard(lambda: self._procs.channel.send(msg, wait=self._wait("the step broadcast")))
            self._outstanding.append(step)
        return step

    def _receive(self, step: RemoteStep) -> None:
        """Receive results in launch order up to `step`'s (a step the engine dropped is skipped)."""
        with self._exchange():
            while step._out is None:
                self._check_alive()
                head = self._outstanding.popleft()
                out = self._guard(lambda: self._procs.channel.recv_result(wait=self._wait("a model step")))
                head._out, head.prompt_logprobs = split_step_result(out)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise WorkerError(f"the {self._procs.role} workers are shut down ({self._dead})")

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers (idempotent): graceful receives the steps in flight, sends the workers None
        and joins them; else terminate/kill."""
        if self._dead is None:
            if graceful:
                graceful = self._drain()
            if self._dead is None:
                self._dead = "shut down by the driver"
        if self._finalizer.detach() is not None:
            self._procs.close(graceful)

    def _drain(self) -> bool:
        """Receive the tokens of steps in flight: rank 0's sender thread must deliver them before that
        worker can exit."""
        try:
            if self._outstanding:
                self._receive(self._outstanding[-1])
            return True
        except Exception as e:  # noqa: BLE001 - shutting down anyway (_guard has closed the workers)
            logger.debug("tokens of the steps in flight not received: %s", e)
            return False

    # RL: weight sync and sleep mode on every worker (`fxrewrite.runtime.worker.worker.Worker.control`)
    def load_weights(self, weights: list[tuple[str, torch.Tensor]], strict: bool = True) -> set[str]:
        """Every worker checks the names and full shapes (ValueError, nothing copied), then takes its slice
        of the tensors, sent once over the driver's group as one byte buffer."""
        metas = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in weights]
        self._control("plan_weights", [(name, shape) for name, shape, _ in metas], strict)
        parts, sizes = [], []
        for _, t in weights:
            data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            pad = -data.numel() % 16  # each tensor starts aligned for its dtype
            parts += [data, torch.zeros(pad, dtype=torch.uint8)]
            sizes.append(data.numel() + pad)
        payload = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
        return self._control("apply_weights", sizes, metas, strict, payload=payload)

    def sleep(self, level: int = 1) -> None:
        """Every rank (each pipeline stage holds weights and KV cache) sleeps; RuntimeError naming the ranks
        when they end up in different states."""
        self._control("sleep", level)
        self.sleep_status()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._control("wake_up", tags)
        self.sleep_status()

    def sleep_status(self):
        """As `ModelRunner.sleep_status`, combined over every worker rank's last report: asleep only when every
        rank is; RuntimeError naming the ranks of each state when they disagree."""
        return combine_rank_statuses(self._ranks)

    def rank_statuses(self) -> list[dict]:
        """Each worker's report, asked now: {"rank", "stage", "tp_rank", "sleep" (its runner's sleep_status),
        "error": None, "memory": {"kv_cache", "weights"} bytes held}, in rank order."""
        self._control("status")
        return [dict(r) for r in self._ranks]

    def _control(self, method: str, *args, payload: torch.Tensor | None = None):
        """Send a ControlMessage (after the steps in flight are received), then `payload`; return the result
        or raise the first rank's error (ValueError / TypeError as such, else RuntimeError)."""
        self._check_alive()
        with self._exchange(method):
            self._check_alive()
            if self._outstanding:
                self._receive(self._outstanding[-1])
            wait = self._wait(method)
            self._guard(lambda: self._procs.channel.send(ControlMessage(method, args), wait=wait))
            if payload is not None:  # big: on gloo, whatever the channel
                self._guard(lambda: wait(dist.broadcast(payload, 0, async_op=True)))
            reply = self._guard(lambda: self._procs.channel.recv_result(wait=wait))
        self._ranks = reply["ranks"]
        if reply["error"] is not None:
            kind, text = reply["error"]
            raise {"ValueError": ValueError, "TypeError": TypeError}.get(kind, RuntimeError)(text)
        return reply["result"]

    def check_health(self) -> None:
        """WorkerError once a worker has failed or the workers were shut down. A worker that exits between
        steps is noticed here too (its process sentinel is polled; the others are then stopped)."""
        self._check_alive()
        if self._procs.lock.acquire(blocking=False):  # else a step is running, and it watches the workers
            try:
                self._guard(lambda: _check_workers(self._procs, "the wait between steps"))
            finally:
                self._procs.lock.release()

    def worker_pids(self) -> list[int]:
        ctx = self._procs.context
        return [p.pid for p in ctx.processes] if ctx is not None else []


class RemoteStep:
    """A step sent to the workers; `result()` waits for its tokens (rank 0 sends them in step order)."""

    def __init__(self, executor: MultiprocExecutor, sched):
        self.sched = sched
        self._executor = executor
        self._seqs = {s.seq.seq_id: s.seq for s in sched.scheduled}
        self._out: list | None = None
        self.prompt_logprobs: list | None = None
        """The step's `PromptLogprobsChunk`s (with `result()`), as `PendingStep`'s."""

    def result(self):
        """(driver Sequences that sampled, their SampleResults); WorkerError when a worker failed."""
        if self._out is None:
            self._executor._receive(self)
        return [self._seqs[seq_id] for seq_id, _ in self._out], [result for _, result in self._out]

    def token_ids(self) -> tuple[list, list[int]]:
        """(driver Sequences that sampled, their token ids): what the grammar process accepts."""
        seqs, results = self.result()
        return seqs, [r.token_id for r in results]
