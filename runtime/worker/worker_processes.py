"""The worker processes a multi-process executor holds, and how it waits on them.

`_Processes` holds the spawn context, store and step channel (it is the executor's finalizer, so it
never refers to the executor); `_poll` waits for a torch.distributed work item while watching the
workers' sentinels; `_failure` tells the first failed worker's story; `WorkerGuard` gives the
executors (`MultiprocExecutor`, `DPExecutor`) their `_wait` / `_guard`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import signal
import sys
import threading
import time

from fxrewrite import distributed
from fxrewrite.errors import UnsupportedModelError, UserInputError

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 1800.0
"""Workers must have built their model shards within this (large checkpoints load slowly)."""
STEP_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 10.0


def spawn_workers(entry, args: tuple, nprocs: int):
    """`torch.multiprocessing.start_processes(entry, args, nprocs, join=False, start_method="spawn")`. A main module
    whose `__file__` is not a file (a script piped to `python -`: '<stdin>') is not re-run in the workers: spawn would
    try to open it and every worker would die at start, while the workers need nothing from it (their entry point
    and arguments are this package's)."""
    import torch.multiprocessing as mp

    check_not_bootstrapping()
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    hide = isinstance(path, str) and not os.path.isfile(path)
    if hide:
        del main.__file__
    try:
        return mp.start_processes(entry, args=args, nprocs=nprocs, join=False, start_method="spawn")
    finally:
        if hide:
            main.__file__ = path


UNGUARDED_SCRIPT_EXIT = 78
"""A worker's exit status when its parent's script starts workers at top level (sysexits' EX_CONFIG)."""


def unguarded_script_error() -> UserInputError:
    main = sys.modules.get("__mp_main__") or sys.modules.get("__main__")  # a worker imports the script as the former
    return UserInputError(f"{getattr(main, '__file__', 'the script')} started worker processes from a worker process: "
                          "the workers (tensor / pipeline / data parallelism) import the script that starts them, so "
                          "put the code that creates the LLM under `if __name__ == \"__main__\":`")


def check_not_bootstrapping() -> None:
    """In a spawned process importing its parent's script (as `__mp_main__`) that starts workers at top level (every
    worker would start workers again): print the fix and exit with UNGUARDED_SCRIPT_EXIT, which the parent's
    `_failure` turns into the same UserInputError (Python's own message for it does not name the fix)."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):  # what multiprocessing's own check reads
        print(f"fxrewrite worker: {unguarded_script_error()}", file=sys.stderr, flush=True)
        os._exit(UNGUARDED_SCRIPT_EXIT)


class _Processes:
    """The spawn context and store; `close` is the finalizer (no reference to the executor)."""

    def __init__(self, role: str = "tensor-parallel", ranks: str = "process i is TP rank i") -> None:
        self.role, self.ranks = role, ranks
        """What the workers are, for error messages ("data-parallel"), and which rank each process is."""
        self.context = None
        self.store = self.channel = None  # channel: ShmChannel or GlooChannel (`step_channel`)
        self.joined_group = False
        self.activity = "a step exchange"
        """What the driver is exchanging with the workers now (a control call names itself: "load_weights"), for
        a failure found by the shared-memory queue's wait (`_check_workers`)."""
        self.send_stop = None
        """`send_stop(wait)`: tells every worker to exit; None: send None on `channel`."""
        # The server steps in a worker thread; the exit-time shutdown must not interleave with a step.
        self.lock = threading.RLock()

    def close(self, graceful: bool) -> None:
        with self.lock:
            self._close(graceful)

    def _close(self, graceful: bool) -> None:
        if graceful and self.joined_group and self.context is not None and self.context.sentinels:
            try:
                wait = lambda w: _poll(w, self, SHUTDOWN_TIMEOUT_S, "shutdown")  # noqa: E731
                self.send_stop(wait) if self.send_stop is not None else self.channel.send(None, wait=wait)
            except Exception as e:  # noqa: BLE001 - a dead worker must not stop the shutdown
                logger.debug("shutdown message not delivered: %s", e)
        if self.context is not None:
            _stop_processes(self.context.processes, SHUTDOWN_TIMEOUT_S if graceful else 0.0)
            self.context = None
        if self.channel is not None:
            self.channel.close()
            self.channel = None
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
    """A worker process (tensor- or data-parallel) died or failed; the engine is shut down."""


_USER_ERROR = "fxrewrite/worker_user_error"


@contextlib.contextmanager
def reporting_user_errors(store, rank: int):
    """Worker side, around loading the model: a UserInputError (a checkpoint missing a tensor, a KV cache that does
    not fit) goes to the driver through `store` and the process exits without a traceback, so the driver raises
    that one error (`_failure`) instead of a rank's traceback."""
    try:
        yield
    except UserInputError as e:  # the kind travels too: an UnsupportedModelError stays one (a NotImplementedError)
        kind = "unsupported" if isinstance(e, UnsupportedModelError) else "input"
        store.set(f"{_USER_ERROR}/{rank}", f"{kind}:{e}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _user_error(procs: _Processes) -> UserInputError | None:
    """The first rank's UserInputError (or UnsupportedModelError) `reporting_user_errors` left in the store, if any."""
    if procs.store is None or procs.context is None:
        return None
    for rank in range(1, len(procs.context.processes) + 1):
        key = f"{_USER_ERROR}/{rank}"
        if procs.store.check([key]):
            kind, _, message = procs.store.get(key).decode().partition(":")
            return (UnsupportedModelError if kind == "unsupported" else UserInputError)(message)
    return None


def _poll(work, procs: _Processes, timeout: float, what: str) -> None:
    """Wait for a torch.distributed work item while watching the worker processes."""
    start = time.monotonic()
    sentinels = list(procs.context.sentinels) if procs.context is not None else []
    while not work.is_completed():
        elapsed = time.monotonic() - start
        if elapsed > timeout:
            raise WorkerError(f"{procs.role} workers did not answer within {timeout:.0f} s ({what})")
        # 50 us late at most while steps flow (a decode step is a few ms), 1 ms once idle for a second.
        if sentinels and multiprocessing.connection.wait(sentinels, timeout=5e-5 if elapsed < 1.0 else 1e-3):
            raise _failure(procs, what)
    try:
        work.wait()
    except RuntimeError as e:  # gloo reports a dead peer as a closed connection
        raise _failure(procs, what, e) from e


def _check_workers(procs: _Processes, what: str | None = None) -> bool:
    """True while every worker runs, else raises `_failure` naming `what` (default: `procs.activity`; polled by the
    shared-memory queues' waits)."""
    sentinels = list(procs.context.sentinels) if procs.context is not None else []
    if sentinels and multiprocessing.connection.wait(sentinels, timeout=0):
        raise _failure(procs, what or procs.activity)
    return True


def _failure(procs: _Processes, what: str, cause: BaseException | None = None) -> WorkerError | UserInputError:
    """The first failed worker's story (exit code / signal / traceback, from torch's spawn context), or the
    UserInputError a worker reported (`reporting_user_errors`)."""
    from torch.multiprocessing.spawn import ProcessException

    detail = str(cause) if cause is not None else "a worker process exited"
    if procs.context is None:
        return WorkerError(f"{procs.role} worker failed during {what}: {detail}")
    pids = [p.pid for p in procs.context.processes]
    try:
        procs.context.join(timeout=5.0, grace_period=1.0)
    except ProcessException as e:
        detail = str(e).strip()
    except Exception as e:  # noqa: BLE001
        detail = f"{detail}; {e}"
    user_error = _user_error(procs)
    if user_error is not None:
        return user_error
    if any(p.exitcode == UNGUARDED_SCRIPT_EXIT for p in procs.context.processes):
        return unguarded_script_error()
    return WorkerError(f"{procs.role} worker failed during {what} ({procs.ranks}; pids {pids}): {detail}")


@contextlib.contextmanager
def interrupts_deferred(role: str):
    """In the main thread under Python's own SIGINT handler: a Ctrl-C during the block is raised as KeyboardInterrupt
    when the block ends, so the step exchange it interrupted completes and the workers stay in step with the driver
    (an interrupted `LLM.generate` aborts its requests and the engine serves on, as on one process); a second Ctrl-C
    raises at once (the workers are then shut down: a hung step). Elsewhere (a server's stepping thread, a handler
    of the user's) the block runs as it is."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    hits = []

    def handler(signum, frame):
        hits.append(signum)
        if len(hits) > 1:
            raise KeyboardInterrupt
        logger.warning("Ctrl-C: finishing the %s workers' step in flight (Ctrl-C again stops them)", role)

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hits:
        raise KeyboardInterrupt


class WorkerGuard:
    """Waits on workers for the multi-process executors (uses `_procs`, `_dead`, `shutdown`): `_wait` polls
    the workers' sentinels while `work` runs; `_guard(fn)` shuts every worker down when fn fails; `_exchange()`
    holds the lock around a step's exchange with the workers, a Ctrl-C deferred to its end."""

    @contextlib.contextmanager
    def _exchange(self, activity: str = "a step exchange"):
        with self._procs.lock, interrupts_deferred(self._procs.role):
            self._procs.activity = activity  # what a worker's failure found meanwhile names
            try:
                yield
            finally:
                self._procs.activity = "a step exchange"

    def _wait(self, what: str, timeout: float = STEP_TIMEOUT_S):
        return lambda work: _poll(work, self._procs, timeout, what)

    def _guard(self, fn):
        try:
            return fn()
        except BaseException as e:
            self._dead = self._dead or f"{type(e).__name__}: {e}"  # the first failure tells the story
            self.shutdown(graceful=False)
            raise
