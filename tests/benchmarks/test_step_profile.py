"""The bench's host-time profile (`step_profile`) covers a pipelined executor's micro-batches: it is not
async-scheduled (supports_async False) but launches every micro-batch through execute_model_async."""

from __future__ import annotations

import time

from fxrewrite.benchmarks.common import step_profile


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
    assert "execute_model_async" not in vars(runner)  # the class's method is back


def test_step_profile_leaves_a_synchronous_runner_alone():
    runner = _PipelinedRunner()
    runner.pipeline_depth = 1
    with step_profile(runner) as profile:
        runner.execute_model_async(object()).result()
    assert profile == {"launch": 0.0, "wait": 0.0, "steps": 0}
