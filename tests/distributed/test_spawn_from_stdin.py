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
