"""`LLM.generate` raises the young-generation GC threshold for its run and restores it after."""

import gc

import pytest

from fxrewrite.runtime.llm import fewer_gc_passes


def test_threshold_raised_then_restored():
    old = gc.get_threshold()
    with fewer_gc_passes(123_456):
        assert gc.get_threshold() == (max(old[0], 123_456), *old[1:])
    assert gc.get_threshold() == old
    with pytest.raises(RuntimeError), fewer_gc_passes(10):  # never lowered; restored on an error too
        assert gc.get_threshold()[0] == max(old[0], 10)
        raise RuntimeError("boom")
    assert gc.get_threshold() == old
