"""How the driver and its workers exchange per-step messages: shared memory on one host, else gloo.

Two directions: the driver sends every worker each `StepMessage` / `ControlMessage` / ``None``
(shut down); the results rank (TP rank 0 of the last pipeline stage) sends the driver each step's
sampled tokens and each control reply, in order. Startup (the TCPStore handshake, the model info)
and the weight payload of a weight sync stay on gloo.

- `ShmChannel`: two `ShmQueue`s made by the driver (which owns and removes them): steps (one reader
  per worker) and results (the driver reads). A gloo round trip costs milliseconds; this, tens of
  microseconds (``python -m fxrewrite.benchmarks.step_exchange``).
- `GlooChannel`: pickled broadcasts on the default group and the (driver, results rank) group; used
  when ``FXREWRITE_STEP_TRANSPORT=gloo``, when shared memory cannot be made, or when a worker cannot
  attach to it (another host).

Failures: a driver-side call raises `PeerDiedError` / `TimeoutError` (shm) or what `wait` raises
(gloo); the executor turns them into its WorkerError.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket

import torch
import torch.distributed as dist

from fxrewrite.runtime.worker.shm_queue import SPIN_S, QueueHandle, ShmQueue

logger = logging.getLogger(__name__)

TRANSPORT_ENV = "FXREWRITE_STEP_TRANSPORT"
"""``shm`` (the default: shared memory when every worker can attach) or ``gloo``."""


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


def spin_seconds(num_processes: int) -> float:
    """How long a queue wait spins: SPIN_S when every process (driver and workers) can have a core of
    its own, else 0 (nap at once; on an oversubscribed CPU a spinning reader slows the workers down)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return SPIN_S if cores > num_processes else 0.0


def requested_transport() -> str:
    """`TRANSPORT_ENV`'s value; ValueError for anything but shm / gloo."""
    value = os.environ.get(TRANSPORT_ENV, "shm").strip().lower() or "shm"
    if value not in ("shm", "gloo"):
        raise ValueError(f"{TRANSPORT_ENV}={value!r}: expected 'shm' or 'gloo'")
    return value


class GlooChannel:
    """Messages as pickled gloo broadcasts (see the module docstring)."""

    kind = "gloo"

    def __init__(self, results_rank: int, driver_group) -> None:
        self.results_rank, self.driver_group = results_rank, driver_group

    def send(self, obj, wait=None) -> None:
        """Driver: `obj` to every worker."""
        broadcast_object(obj, 0, wait=wait)

    def recv(self):
        """Worker: the driver's next message."""
        return broadcast_object(None, 0)

    def send_result(self, obj) -> None:
        """Results rank: `obj` to the driver."""
        broadcast_object(obj, self.results_rank, self.driver_group)

    def recv_result(self, wait=None):
        """Driver: the results rank's next message."""
        return broadcast_object(None, self.results_rank, self.driver_group, wait=wait)

    def close(self) -> None:
        pass


class ShmChannel:
    """Messages through two `ShmQueue`s (see the module docstring). `steps` / `results` are the ends
    this process uses (None where it has no part)."""

    kind = "shm"

    def __init__(self, steps: ShmQueue | None, results: ShmQueue | None, timeout: float | None = None) -> None:
        self.steps, self.results, self.timeout = steps, results, timeout

    @classmethod
    def create(cls, num_workers: int, is_alive, timeout: float) -> ShmChannel:
        """Driver: make both queues. `is_alive()` (False once a worker died) is polled while waiting."""
        spin_s = spin_seconds(num_workers + 1)
        steps = ShmQueue.create(num_workers, is_alive=is_alive, spin_s=spin_s)
        try:
            results = ShmQueue.create(1, reader=0, is_alive=is_alive, spin_s=spin_s)
        except BaseException:
            steps.close()
            raise
        return cls(steps, results, timeout)

    def handles(self) -> tuple[str, QueueHandle, QueueHandle]:
        """What the workers need to attach: (this host's name, steps, results)."""
        return socket.gethostname(), self.steps.handle, self.results.handle

    @classmethod
    def attach(cls, handles, worker: int, sends_results: bool) -> ShmChannel | None:
        """Worker `worker` (0-based): open the queues; None when they are not reachable from here."""
        host, steps_handle, results_handle = handles
        if host != socket.gethostname():
            return None
        spin_s = spin_seconds(steps_handle.n_readers + 1)
        try:
            steps = ShmQueue.attach(steps_handle, reader=worker, spin_s=spin_s)
            results = ShmQueue.attach(results_handle, reader=None, spin_s=spin_s) if sends_results else None
        except OSError as e:
            logger.warning("shared-memory step queue not reachable (%s): using gloo", e)
            return None
        return cls(steps, results)

    def send(self, obj, wait=None) -> None:
        self.steps.put(obj, timeout=self.timeout)

    def recv(self):
        return self.steps.get()

    def send_result(self, obj) -> None:
        self.results.put(obj)

    def recv_result(self, wait=None):
        return self.results.get(timeout=self.timeout)

    def close(self) -> None:
        for q in (self.steps, self.results):
            if q is not None:
                q.close()


# The choice, made at startup through the executor's TCPStore: each worker says whether it attached.
def driver_shm_channel(num_workers: int, is_alive, timeout: float) -> ShmChannel | None:
    """Driver, before the workers start: a ShmChannel unless gloo is requested or /dev/shm fails."""
    if requested_transport() != "shm":
        return None
    try:
        return ShmChannel.create(num_workers, is_alive, timeout)
    except OSError as e:  # no /dev/shm, or it is full
        logger.warning("no shared memory for the step queue (%s): steps go over gloo", e)
        return None


def worker_shm_channel(store, handles, local_rank: int, sends_results: bool) -> ShmChannel | None:
    """Worker, before it reports ready: attach (when offered) and tell the driver whether it could."""
    shm = ShmChannel.attach(handles, local_rank, sends_results) if handles is not None else None
    store.set(f"fxrewrite/shm_attached/{local_rank + 1}", "1" if shm is not None else "0")
    return shm


def settle_driver_channel(store, shm: ShmChannel | None, num_workers: int) -> ShmChannel | None:
    """Driver, once every worker is ready: keep `shm` only if all attached; publish the choice."""
    keys = [f"fxrewrite/shm_attached/{r}" for r in range(1, num_workers + 1)]
    if shm is not None and not all(store.get(k) == b"1" for k in keys):
        logger.warning("a worker could not attach to the shared-memory step queue: steps go over gloo")
        shm.close()
        shm = None
    store.set("fxrewrite/step_transport", "shm" if shm is not None else "gloo")
    return shm


def settle_worker_channel(store, shm: ShmChannel | None, results_rank: int, driver_group):
    """Worker: the channel the driver chose (waits for its store key)."""
    if store.get("fxrewrite/step_transport").decode() == "shm":
        return shm
    if shm is not None:
        shm.close()
    return GlooChannel(results_rank, driver_group)
