"""The bench's host-time profile (`step_profile`) covers a pipelined executor's micro-batches: it is not
async-scheduled (supports_async False) but launches every micro-batch through execute_model_async."""

from __future__ import annotations

import time

from fxrewrite.benchmarks.step_profile import step_profile


class _Pending:
    def result(self):
        time.sleep(0.002)
        return [], []


class _PipelinedRunner:
    supports_async = False
    pipeline_depth = 2

    def execute_model_async(self, sched, previous=None):
        return _Pending()


def test_step_profile_times_pipeline_micro_batches():
    runner = _PipelinedRunner()
    with step_profile(runner) as profile:
        steps = [runner.execute_model_async(object()) for _ in range(3)]
        for step in steps:
            step.result()
    assert profile["steps"] == 3 and profile["wait"] >= 0.006
    # object() has no scheduled sequences: every step falls in no band (bands start at one sequence)
    assert profile["by_batch"] == {}
    assert "execute_model_async" not in vars(runner)  # the class's method is back


def test_step_profile_leaves_a_synchronous_runner_alone():
    runner = _PipelinedRunner()
    runner.pipeline_depth = 1
    with step_profile(runner) as profile:
        runner.execute_model_async(object()).result()
    assert profile == {"launch": 0.0, "wait": 0.0, "steps": 0}


def test_step_profile_splits_steps_by_scheduled_sequences():
    class _Sched:
        def __init__(self, n):
            self.scheduled = [None] * n

    runner = _PipelinedRunner()
    sizes = [200, 150, 40, 3, 1]
    with step_profile(runner) as profile:
        for n in sizes:
            runner.execute_model_async(_Sched(n)).result()
    bands = profile["by_batch"]
    assert {k: v["steps"] for k, v in bands.items()} == {"1-7": 2, "32-127": 1, "128+": 2}
    assert all(v["wait_ms"] >= 2.0 for v in bands.values())  # each result() sleeps 2 ms
    assert bands["128+"]["interval_ms"] >= 2.0 and bands["1-7"]["interval_ms"] >= 2.0  # the last step has none
