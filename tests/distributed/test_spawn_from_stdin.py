"""Workers start when the main script is not a file (piped to `python -`, `__file__` '<stdin>'): spawn would re-run
it in every worker, fail to open it, and each worker died at start with exit code 1."""

import operator
import sys

from fxrewrite.runtime.worker.worker_processes import spawn_workers


def test_workers_start_under_a_main_module_that_is_no_file(monkeypatch):
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "__file__", "<stdin>", raising=False)
    monkeypatch.setattr(main, "__spec__", None, raising=False)  # pytest's own main may be run as a module
    context = spawn_workers(operator.add, (0,), 1)  # operator.add(rank, 0): a picklable entry point
    while not context.join(timeout=60):
        pass
    assert [p.exitcode for p in context.processes] == [0]
    assert main.__file__ == "<stdin>"  # put back


def test_a_script_without_the_main_guard_gets_the_fix_named(tmp_path, tiny_qwen3_dir):
    """A script starting workers at top level: each spawned worker imports it as `__mp_main__` and reaches the
    start again; that worker prints the fix (`if __name__ == "__main__":`, which Python's own bootstrapping message
    does not name) and exits, before making the step queues' shared memory (which it leaked), with a status the
    driver turns into the same UserInputError, not "process 0 terminated with exit code 1"."""
    import subprocess

    script = tmp_path / "no_guard.py"
    script.write_text("from fxrewrite import LLM\n"
                      f"LLM({str(tiny_qwen3_dir)!r}, tensor_parallel_size=2, device='cpu',\n"
                      "    kv_cache_memory_bytes=1 << 20)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert f"fxrewrite.errors.UserInputError: {script} started worker processes from a worker process" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr and "leaked" not in done.stderr
    assert "terminated with exit code" not in done.stderr
