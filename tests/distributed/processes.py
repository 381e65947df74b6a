"""Joining spawned rank processes with a deadline: a rank that deadlocks fails the test instead of
hanging the suite (issue 15 item 16). Light on purpose: spawned children import this module."""

from __future__ import annotations

import contextlib
import time

import pytest


def join_or_fail(ctx, timeout_s: float, what: str = "ranks") -> None:
    """Wait for every process of `ctx` (`torch.multiprocessing.start_processes(..., join=False)`); a
    rank that raised re-raises here (torch's ProcessRaisedException). After `timeout_s` seconds the
    processes still alive are killed and the test fails, naming them."""
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
            for i in alive:
                ctx.processes[i].kill()
            for i in alive:
                ctx.processes[i].join(10)
            pytest.fail(f"{what} {alive} did not finish within {timeout_s:g} s (deadlock?); killed")


@contextlib.contextmanager
def killed_on_error(ctx):
    """Kill and reap `ctx`'s processes if the block raises (the test's own work while its ranks run), then re-raise:
    no rank is left waiting on a collective that never comes."""
    try:
        yield
    except BaseException:
        for p in ctx.processes:
            p.kill()
        for p in ctx.processes:
            p.join(10)
        raise


def hang(rank: int, seconds: float) -> None:
    """A rank that never reaches its collective (for the deadline test)."""
    time.sleep(seconds)
