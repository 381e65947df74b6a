"""CPU thread sizing: one rule for the in-process engine and the worker processes; a user's choice wins."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.runtime.worker import cpu_threads
from fxrewrite.runtime.worker.cpu_threads import cpu_thread_count, size_cpu_threads


@pytest.mark.parametrize("cpus, load, processes, want", [
    (2, 0.2, 1, 2),   # idle: every CPU
    (2, 1.0, 1, 2),   # the load is our own process
    (2, 3.9, 1, 1),   # other programs hold the cores: one thread (OpenMP waits for its slowest thread)
    (8, 3.0, 1, 6),
    (8, 0.0, 2, 4),   # two workers split the CPUs
    (2, 0.0, 4, 1),   # never below one
    (16, 40.0, 2, 1),
])
def test_thread_count(cpus, load, processes, want):
    assert cpu_thread_count(processes, cpus=cpus, load=load) == want


@pytest.fixture
def restore_threads(monkeypatch):
    previous = torch.get_num_threads()
    for name in cpu_threads.USER_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    yield
    torch.set_num_threads(previous)


def _busy_machine(monkeypatch, cpus=2, load=3.9):
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: cpus)
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (load, load, load))


def test_engine_lowers_threads_on_a_busy_machine(tiny_qwen3_dir, monkeypatch, restore_threads):
    from fxrewrite.runtime.llm import LLM

    torch.set_num_threads(2)
    monkeypatch.setattr(cpu_threads, "_THREADS_AT_IMPORT", 2)  # torch's own default, not the user's choice
    _busy_machine(monkeypatch)
    LLM(str(tiny_qwen3_dir), device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 20)
    assert torch.get_num_threads() == 1


def test_a_users_choice_is_kept(monkeypatch, restore_threads):
    _busy_machine(monkeypatch)
    monkeypatch.setattr(cpu_threads, "_THREADS_AT_IMPORT", 2)
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert size_cpu_threads(1) == 2 and torch.get_num_threads() == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(3)  # torch.set_num_threads after import: the user's
    assert size_cpu_threads(1) == 3 and torch.get_num_threads() == 3


def test_never_raised(monkeypatch, restore_threads):
    _busy_machine(monkeypatch, cpus=8, load=0.0)
    torch.set_num_threads(1)
    monkeypatch.setattr(cpu_threads, "_THREADS_AT_IMPORT", 1)
    assert size_cpu_threads(1) == 1 and torch.get_num_threads() == 1
