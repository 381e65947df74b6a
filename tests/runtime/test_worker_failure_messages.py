"""A failed worker process is named by its role and rank layout: a data-parallel replica's death is not reported as
a tensor-parallel worker's."""

from types import SimpleNamespace

from torch.multiprocessing.spawn import ProcessExitedException

from fxrewrite.runtime.worker.worker_processes import WorkerError, _failure, _Processes


class _DeadContext:
    processes = [SimpleNamespace(pid=101, exitcode=None), SimpleNamespace(pid=102, exitcode=-9)]

    def join(self, timeout, grace_period):
        raise ProcessExitedException("process 1 terminated with signal SIGKILL", error_index=1, error_pid=102,
                                     exit_code=-9, signal_name="SIGKILL")


def _message(procs: _Processes) -> str:
    procs.context = _DeadContext()
    error = _failure(procs, "a step exchange")
    assert isinstance(error, WorkerError)
    return str(error)


def test_data_parallel_worker_death_names_dp_ranks():
    message = _message(_Processes("data-parallel", "process i is DP rank i // 1, TP rank i % 1"))
    assert message.startswith("data-parallel worker failed during a step exchange (process i is DP rank i // 1")
    assert "pids [101, 102]" in message and "SIGKILL" in message


def test_tensor_parallel_is_the_default_role():
    assert _message(_Processes()).startswith("tensor-parallel worker failed during a step exchange (process i is TP "
                                             "rank i;")


def test_a_death_seen_by_the_queue_wait_names_the_control_call_running():
    """A worker killed during `load_weights` was reported as failing "during a step exchange" (the shared-memory
    queue's liveness check named every exchange so); a control call's exchange now names the call."""
    import multiprocessing

    import pytest

    from fxrewrite.runtime.worker.worker_processes import WorkerGuard, _check_workers

    reader, writer = multiprocessing.Pipe(duplex=False)
    writer.close()  # a sentinel that is ready, as a dead process's
    procs = _Processes()
    procs.context = _DeadContext()
    procs.context.sentinels = [reader]
    guard = WorkerGuard()
    guard._procs = procs
    with guard._exchange("load_weights"), pytest.raises(WorkerError, match="failed during load_weights "):
        _check_workers(procs)
    assert procs.activity == "a step exchange"
    with pytest.raises(WorkerError, match="failed during a step exchange "):
        _check_workers(procs)
