"""A Ctrl-C while the driver exchanges a step with its workers is raised once the exchange completes (the workers
stay in step); a second one is raised at once; outside the main thread nothing changes."""

import _thread
import signal
import threading

import pytest

from fxrewrite.runtime.worker.worker_processes import interrupts_deferred

pytestmark = pytest.mark.usefixtures("python_sigint")


def test_one_ctrl_c_is_raised_when_the_exchange_ends():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred("tensor-parallel"):
            _thread.interrupt_main()
            done.append("exchange completed")
    assert done == ["exchange completed"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_is_raised_at_once():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred("tensor-parallel"):
            _thread.interrupt_main()
            _thread.interrupt_main()
            done.append("not reached")
    assert done == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_other_threads_and_handlers_are_left_alone():
    seen = []

    def in_thread():
        with interrupts_deferred("data-parallel"):
            seen.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    assert seen == [signal.default_int_handler]
    mine = lambda signum, frame: None  # noqa: E731
    previous = signal.signal(signal.SIGINT, mine)
    try:
        with interrupts_deferred("tensor-parallel"):
            assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)
