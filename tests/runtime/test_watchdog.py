"""The worker watchdog names a phase that lasts too long (with every thread's stack, once), stays quiet for
unwatched phases (an idle engine waiting for the driver) and is a no-op in a process without one."""

from __future__ import annotations

import time

from fxrewrite.runtime.worker import watchdog
from fxrewrite.runtime.worker.watchdog import PhaseWatchdog


def test_a_stuck_phase_is_reported_with_the_stacks_once(capfd):
    dog = PhaseWatchdog("DP rank 1 TP rank 0 (pid 1)", period_s=0.2)
    try:
        dog.phase("CUDA graph bucket 256: capture")
        dog.phase("waiting for step 3's sampled tokens", slot="results")
        time.sleep(0.9)
        dog.phase("waiting for the driver's next wave", watched=False)
        dog.phase("idle", watched=False, slot="results")
        err = capfd.readouterr().err
        time.sleep(0.5)
        assert capfd.readouterr().err == ""  # unwatched phases: nothing more
    finally:
        dog.stop()
    assert "[fxrewrite watchdog] DP rank 1 TP rank 0 (pid 1) (main): still in 'CUDA graph bucket 256: capture'" in err
    assert "(results): still in 'waiting for step 3's sampled tokens'" in err
    assert err.count("most recent call first") >= 2  # one dump per stuck phase (faulthandler's format)
    assert dog.current() == "waiting for the driver's next wave" and dog.current("results") == "idle"


def test_phase_without_a_watchdog_is_a_no_op():
    if watchdog._watchdog is None:  # this process (the test runner) has none
        watchdog.phase("anything")
        assert watchdog.current_phase() is None
