"""A tensor-parallel worker process: one per rank; holds its model shard and its KV heads, runs steps.

Protocol (groups: see `fxrewrite.distributed`): world rank 0 is the driver
(`fxrewrite.runtime.worker.executor`), ranks 1..N the workers. Each step the driver sends every worker a
`StepMessage` through the step channel (`fxrewrite.runtime.worker.step_channel`: shared memory on one
host, else gloo); every worker applies it to its `SequenceMirror` and launches the step
(`ModelRunner.execute_model_async`; the model's collectives run on the TP group), and TP rank 0 sends
that step's ``[(seq_id, SampleResult), ...]`` back through the channel as soon as they reach the host.
``None`` means shut down.

Async scheduling: the driver may send step n+1 before it has step n's tokens; such a token is "pending"
in the message, and each worker feeds it from its own step n's sampled tokens on the device, exactly as
the single-process engine does. Sampling state lives in the workers' mirrors: a seeded request's
generator advances there only, and every rank samples the same gathered logits.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import queue
import signal
import sys
import threading
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

from fxrewrite import distributed
from fxrewrite.runtime.worker.cpu_threads import size_cpu_threads
from fxrewrite.runtime.worker.model_runner import ModelRunner
from fxrewrite.runtime.worker.step_channel import broadcast_object, settle_worker_channel, worker_shm_channel
from fxrewrite.runtime.worker.step_messages import SequenceMirror, StepMessage
from fxrewrite.runtime.worker import sleep_mode, watchdog
from fxrewrite.runtime.worker.worker_processes import reporting_user_errors


@dataclasses.dataclass
class ControlMessage:
    """A call on every worker between steps (weight sync, sleep mode, "status": `Worker.control`); TP rank 0
    of the last stage replies {"result", "error": (exception type name, text) or None, the first of any rank,
    "ranks": every worker's report, in rank order}. "apply_weights" is followed by one uint8 broadcast of
    every tensor's bytes (16-byte aligned)."""

    method: str
    args: tuple


def rank_model_config(model_config, tp_size: int):
    """A copy whose num_key_value_heads is the per-rank count (what the KV cache holds): total / tp,
    or 1 when kv heads are replicated (fewer kv heads than ranks)."""
    kv = model_config.num_key_value_heads
    return dataclasses.replace(model_config, num_key_value_heads=max(1, kv // tp_size))


def _agree_over_stages(result, error):
    """(result, error) of a weight-sync call, the same on every pipeline stage. Only the last stage replies, but
    each stage checks and writes its own layers' tensors: the first stage's error wins (so no stage copies
    anything, as with one process), else the result is the union of the parameter names (None for a plan)."""
    state = distributed.get_state()
    if state is None or state.pp_size == 1:
        return result, error
    gathered = [None] * state.pp_size
    dist.all_gather_object(gathered, (result, error), group=state.pp_group)
    errors = [e for _, e in gathered if e is not None]
    if errors:
        return None, errors[0]
    names = [r for r, _ in gathered if r is not None]
    return (set().union(*names) if names else None), None


def _gather_over_workers(obj) -> list:
    """`obj` of every worker in rank order (stage by stage, TP ranks within), on every worker: gathered
    over the stage's TP group, then those lists over the pipeline group (one per TP rank)."""
    state = distributed.get_state()
    stage = [obj]
    if state.tp_size > 1:
        stage = [None] * state.tp_size
        dist.all_gather_object(stage, obj, group=state.tp_group)
    if state.pp_size == 1:
        return stage
    stages = [None] * state.pp_size
    dist.all_gather_object(stages, stage, group=state.pp_group)
    return [report for part in stages for report in part]


def _rank_error(reports: list[dict]):
    """The first rank's error, its text prefixed with the rank; None when every rank succeeded."""
    for r in reports:
        if r["error"] is not None:
            kind, text = r["error"]
            return kind, f"{sleep_mode.rank_label(r)}: {text}"
    return None


class Worker:
    """Builds the rank's `ModelRunner` (model shard, KV cache of its heads) and runs steps."""

    def __init__(self, config, model_config, eos_token_ids: set[int]):
        tp_size = distributed.get_tp_size()
        self.runner = ModelRunner(config, rank_model_config(model_config, tp_size), eos_token_ids)
        self.mirror = SequenceMirror()
        self._plan = None
        """The weight update checked by "plan_weights", copied by the "apply_weights" that follows."""

    def num_blocks(self) -> int:
        """The smallest KV block count over the TP ranks (what the driver's block manager may use)."""
        # On the runner's device: the TP group is NCCL on GPUs, and NCCL has no CPU tensors.
        n = torch.tensor([self.runner.num_blocks], dtype=torch.int64, device=self.runner.device)
        dist.all_reduce(n, op=dist.ReduceOp.MIN, group=distributed.get_tp_group())
        state = distributed.get_state()
        if state.pp_size > 1:  # and over the pipeline stages
            dist.all_reduce(n, op=dist.ReduceOp.MIN, group=state.pp_group)
        return int(n)

    def control(self, msg: ControlMessage) -> dict:
        """Run a ControlMessage on this rank's runner; errors are returned, not raised (the driver raises)."""
        try:
            if msg.method == "plan_weights":
                self._plan, result = self.runner.plan_weights(*msg.args), None
            elif msg.method == "apply_weights":
                result = self._apply_weights(*msg.args)
            elif msg.method in ("sleep", "wake_up"):
                result = getattr(self.runner, msg.method)(*msg.args)
            elif msg.method == "status":
                result = None
            else:
                raise ValueError(f"unknown control message {msg.method!r}")
            error = None
        except Exception as e:  # noqa: BLE001 - reported to the driver, which raises it
            result, error = None, (type(e).__name__, str(e))
        if msg.method in ("plan_weights", "apply_weights"):
            result, error = _agree_over_stages(result, error)
        ranks = _gather_over_workers(self._report(error))  # every rank holds weights and KV cache
        return {"result": result, "error": error or _rank_error(ranks), "ranks": ranks}

    def _report(self, error) -> dict:
        """This rank's part of a control reply: where it sits, its sleep status, error and memory held."""
        state = distributed.get_state()
        return {"rank": state.rank, "stage": state.pp_rank, "tp_rank": state.tp_rank, "error": error,
                "sleep": self.runner.sleep_status(), "memory": sleep_mode.memory_held(self.runner)}

    def _apply_weights(self, sizes: list[int], metas: list[tuple[str, tuple, str]], strict: bool) -> set[str]:
        buf = torch.empty(sum(sizes), dtype=torch.uint8)
        dist.broadcast(buf, 0)  # received before anything can fail: the driver sends it regardless
        plan, self._plan = self._plan, None
        tensors = []
        for part, (_, shape, dtype) in zip(buf.split(sizes), metas):
            dtype = getattr(torch, dtype)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            tensors.append(part[:nbytes].view(dtype).view(shape))
        return self.runner.apply_weights(plan, tensors, strict)

    def launch(self, msg: StepMessage, previous):
        """Apply the message and launch its step (`previous`: this worker's last step, whose sampled
        tokens feed the pending ones); None when nothing is scheduled."""
        sched = self.mirror.apply(msg)
        if sched.is_empty():
            return None
        if msg.bitmask is None:
            return self.runner.execute_model_async(sched, previous)
        mask = torch.from_numpy(msg.bitmask).to(self.runner.device, non_blocking=True)
        return self.runner.execute_model_async(sched, previous, bitmask_hook=lambda seqs: _rows(mask, seqs))


def _rows(mask: torch.Tensor, seqs: list) -> torch.Tensor:
    if mask.shape[0] != len(seqs):  # the driver's sampling rows are the mirror's: a protocol bug otherwise
        raise RuntimeError(f"grammar bitmask of {mask.shape[0]} rows for a step sampling {len(seqs)} sequences")
    return mask


CLOSE_WAIT_S = 1.0


class ResultSender:
    """TP rank 0's thread that sends each step's tokens to the driver once they reach the host, in step
    order. A thread, so that the main thread can take the next message meanwhile: the driver sends step
    n+1 before it receives step n's tokens (async scheduling), and a gloo send waits for its receiver."""

    def __init__(self, channel, device) -> None:
        self._channel, self._device = channel, torch.device(device)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="fxrewrite-results", daemon=True)
        self._thread.start()

    def send(self, step) -> None:
        """Queue a launched step (`PendingStep`, or None for an empty one: an empty list is sent)."""
        self._queue.put(step)

    def reply(self, payload) -> None:
        """Queue a control message's reply (sent after the tokens of every step queued before it)."""
        self._queue.put(_Reply(payload))

    def close(self) -> None:
        """Stop after what is queued, waiting at most CLOSE_WAIT_S: the driver receives every step it wants
        before it sends the workers None, so a send still blocked then is one nobody will read (a driver closed
        at exit with steps in flight) and the process exits past it (daemon thread, os._exit)."""
        self._queue.put(_STOP)
        self._thread.join(CLOSE_WAIT_S)

    def _run(self) -> None:
        try:
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)  # the current device is per thread
            sent = 0
            while (step := self._queue.get()) is not _STOP:
                if isinstance(step, _Reply):
                    self._channel.send_result(step.payload)
                    continue
                watchdog.phase(f"waiting for step {sent + 1}'s sampled tokens (the device runs it)", slot="results")
                seqs, results = step.result() if step is not None else ([], [])
                watchdog.phase(f"sending step {sent + 1}'s tokens to the driver", slot="results")
                pairs = [(seq.seq_id, r) for seq, r in zip(seqs, results)]
                chunks = getattr(step, "prompt_logprobs", None)  # PromptLogprobsChunks of prompt_logprobs requests
                self._channel.send_result(StepResult(pairs, chunks) if chunks else pairs)
                sent += 1
                watchdog.phase("idle", watched=False, slot="results")
        except BaseException:  # noqa: BLE001 - the process must die, so the driver sees it
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)


_STOP = object()


@dataclasses.dataclass
class StepResult:
    """A step's reply when it computed prompt logprobs (else the bare list of (seq_id, SampleResult) pairs)."""

    pairs: list
    prompt_logprobs: list
    """`PromptLogprobsChunk`s, host lists: the driver stores them as the one-process engine does."""


def split_step_result(out) -> tuple[list, list | None]:
    """Driver side: ((seq_id, SampleResult) pairs, prompt logprob chunks or None) of a step's reply."""
    return (out.pairs, out.prompt_logprobs) if isinstance(out, StepResult) else (out, None)


@dataclasses.dataclass
class _Reply:
    payload: object


def _watch_parent(parent_pid: int) -> None:
    """Exit when the driver is gone (killed with no chance to shut us down)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def rank_of_results(tp_size: int, num_workers: int) -> int:
    """Global rank of TP rank 0 of the last pipeline stage (`ParallelState.results_rank`)."""
    return num_workers - tp_size + 1


def worker_main(local_rank: int, config, model_config, eos_token_ids: set[int], host: str, port: int,
                tp_size: int, parent_pid: int, shm_handles=None) -> None:
    """torch.multiprocessing entry point of worker `local_rank` (global rank local_rank + 1): pipeline stage
    local_rank // tp_size, TP rank local_rank % tp_size of it. `shm_handles`: `ShmChannel.handles()`,
    or None for gloo."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's: it shuts us down
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    watchdog.install(f"worker {local_rank} (pid {os.getpid()})")
    watchdog.phase("joining the process groups")
    backend = distributed.default_backend(config.device)
    config = copy.copy(config)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        config.device = f"cuda:{local_rank}"
    num_workers = tp_size * getattr(config, "pipeline_parallel_size", 1)
    if backend != "nccl":
        size_cpu_threads(num_workers)
        config.device = config.device or "cpu"
    rank = local_rank + 1
    store = dist.TCPStore(host, port, num_workers + 1, is_master=False, timeout=distributed.TP_TIMEOUT)
    shm = worker_shm_channel(store, shm_handles, local_rank, rank == rank_of_results(tp_size, num_workers))
    store.set(f"fxrewrite/worker_ready/{rank}", "1")
    state = distributed.initialize(rank, num_workers + 1, store=store, tp_ranks=list(range(1, num_workers + 1)),
                                   with_driver=True, tp_backend=backend, pp_size=num_workers // tp_size)
    with reporting_user_errors(store, rank):
        worker = Worker(config, model_config, eos_token_ids)
        watchdog.phase("agreeing on the KV cache size")
        num_blocks = worker.num_blocks()
    sends_results = rank == state.results_rank
    if sends_results:
        runner = worker.runner
        info = {"num_blocks": num_blocks, "impl": getattr(runner.model, "impl", None),
                "cuda_graph_buckets": len(runner.graph_runner.graphs) if runner.graph_runner is not None else 0,
                "compiled": bool(getattr(runner.model, "_fxrewrite_compiled", False))}
        broadcast_object(info, rank, state.driver_group)
    channel = settle_worker_channel(store, shm, state.results_rank, state.driver_group)
    sender = ResultSender(channel, config.device) if sends_results else None
    step = None
    while watchdog.phase("waiting for the driver's next step", watched=False) or (msg := channel.recv()) is not None:
        if isinstance(msg, ControlMessage):
            reply = worker.control(msg)
            if sender is not None:
                sender.reply(reply)
            continue
        launched = worker.launch(msg, step)
        step = launched or step
        if sender is not None:
            sender.send(launched)
    exit_worker(sender)


def exit_worker(sender: "ResultSender | None") -> None:
    """Normal shutdown of a worker process: drain its result thread, then exit without destroying the
    process groups (NCCL's destroy_process_group blocks on an H200 pair until the driver kills us; the
    exit frees everything) or the interpreter's slow teardown (nothing is left to flush but stdio)."""
    if sender is not None:
        sender.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
