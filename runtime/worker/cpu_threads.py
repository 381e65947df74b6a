"""How many torch (OpenMP) threads a process that runs the model on a CPU uses.

One rule for the in-process engine (`LLM(...)`, `fxrewrite serve`, `fxrewrite generate`) and for the
worker processes of tensor / pipeline / data parallelism on a CPU (`size_cpu_threads(num_processes)`):
the CPUs this process may run on (its affinity mask; in a container, the cgroup CPU quota), less those
other programs keep busy (the 1-minute load average beyond our own processes), split evenly over the
processes that run the model. Why the load: an OpenMP parallel region waits for its slowest thread, so
a thread whose core another program holds stalls every matmul (measured on a 2-core machine at load
average 3.9: 32 decode steps of 4 prompts through a 4-layer model took 60 s with 2 threads, 8.7 s with 1).

A user's choice wins: nothing changes when OMP_NUM_THREADS or MKL_NUM_THREADS is set, or when the count
was changed (`torch.set_num_threads`) after this module was imported; the count is only ever lowered.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_THREADS_AT_IMPORT = torch.get_num_threads()
USER_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 quota (cpu.max), >= 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))  # a quota of 1.5 CPUs: 2 threads
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def cpu_thread_count(num_processes: int = 1, cpus: int | None = None, load: float | None = None) -> int:
    """Threads for each of `num_processes` model processes: (usable CPUs - CPUs busy with other programs)
    / num_processes, rounded, between 1 and usable CPUs // num_processes. `cpus` / `load` (the 1-minute
    load average) default to this machine's; the load counts our own processes, hence the subtraction."""
    cpus = usable_cpus() if cpus is None else cpus
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    busy_elsewhere = max(0.0, load - num_processes)
    free = (cpus - busy_elsewhere) / num_processes
    return max(1, min(cpus // num_processes, int(free + 0.5)))


def user_chose_threads() -> bool:
    """True when the thread count is the user's: OMP_NUM_THREADS / MKL_NUM_THREADS set, or
    torch.set_num_threads called since this module's import."""
    return any(os.environ.get(v) for v in USER_THREAD_VARIABLES) or torch.get_num_threads() != _THREADS_AT_IMPORT


def size_cpu_threads(num_processes: int = 1) -> int:
    """Lower torch's intra-op threads to `cpu_thread_count(num_processes)` unless the user chose a count
    (`user_chose_threads`); returns the count in force. Call once, where the model will run on a CPU."""
    current = torch.get_num_threads()
    if user_chose_threads():
        return current
    threads = min(current, cpu_thread_count(num_processes))
    if threads != current:
        logger.info("torch CPU threads: %d (was %d; %d usable CPUs, load %.1f, %d model process(es)); set "
                    "OMP_NUM_THREADS or call torch.set_num_threads to choose", threads, current, usable_cpus(),
                    os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0, num_processes)
        torch.set_num_threads(threads)
        global _THREADS_AT_IMPORT
        _THREADS_AT_IMPORT = threads  # our own change is not the user's choice
    return threads
