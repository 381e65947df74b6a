"""The latency workload's step figures: a stall among steady steps, and garbage-collector pauses."""

import gc

import pytest

from fxrewrite.benchmarks.step_timing import collect_untimed, decode_step_summary, gc_pauses


def test_one_stall_among_steady_steps():
    ends = [0.5, 1.0]  # the prefill step ends at 1.0 s (the first token), then 10 ms steps, one of 50 ms
    for interval in [0.010] * 5 + [0.050] + [0.010] * 4:
        ends.append(ends[-1] + interval)
    got = decode_step_summary(ends, first_token_s=1.0, last_token_s=ends[-1])
    assert got["step_ms_median"] == pytest.approx(10.0)
    assert got["step_ms_max"] == pytest.approx(50.0)
    assert got["long_steps"] == 1
    assert got["stall_ms"] == pytest.approx(40.0)


def test_steps_outside_the_decode_window_do_not_count():
    ends = [0.2, 1.0, 1.01, 1.02, 1.03, 5.0]  # a slow prefill before the first token, a step after the last one
    got = decode_step_summary(ends, first_token_s=1.0, last_token_s=1.03)
    assert got["step_ms_max"] == pytest.approx(10.0) and got["long_steps"] == 0 and got["stall_ms"] == 0.0


def test_fewer_than_two_steps_give_no_figures():
    assert decode_step_summary([1.0], 1.0, 1.0) == {}
    assert decode_step_summary([], 0.0, 1.0) == {}


def test_gc_pauses_counts_collections_by_generation():
    with gc_pauses() as got:
        gc.collect(0)
        gc.collect(2)
    assert got["collections"].get("0", 0) >= 1 and got["collections"].get("2", 0) >= 1
    assert got["pause_ms"] >= got["max_pause_ms"] > 0.0
    with gc_pauses() as nothing:
        pass
    assert nothing == {"collections": {}, "pause_ms": 0.0, "max_pause_ms": 0.0}
    with gc_pauses() as harness_own:  # the harness's collection before its clock starts is not a pause of the run
        collect_untimed()
    assert harness_own == {"collections": {}, "pause_ms": 0.0, "max_pause_ms": 0.0}
