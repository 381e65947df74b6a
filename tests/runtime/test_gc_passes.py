"""`LLM.generate` raises the young-generation GC threshold for its run and restores it after; a server freezes its
startup heap while it serves."""

import gc

import pytest

from fxrewrite.runtime import gc_passes
from fxrewrite.runtime.gc_passes import fewer_gc_passes, frozen_startup_heap


@pytest.fixture(autouse=True)
def own_gc_settings(monkeypatch):
    """The settings are process-wide and shared: a server fixture of another test file may hold them for the whole
    session. Each test here starts as the only holder (the other holder's settings stay applied meanwhile)."""
    others_froze = gc_passes._frozen["users"] > 0
    monkeypatch.setattr(gc_passes, "_young", {"users": 0, "saved": None})
    monkeypatch.setattr(gc_passes, "_frozen", {"users": 0})
    yield
    if others_froze:
        gc.freeze()  # the test's unfreeze ended the other holder's: frozen again, as it expects while it runs


def test_threshold_raised_then_restored():
    old = gc.get_threshold()
    with fewer_gc_passes(123_456):
        assert gc.get_threshold() == (max(old[0], 123_456), *old[1:])
    assert gc.get_threshold() == old
    with pytest.raises(RuntimeError), fewer_gc_passes(10):  # never lowered; restored on an error too
        assert gc.get_threshold()[0] == max(old[0], 10)
        raise RuntimeError("boom")
    assert gc.get_threshold() == old


def test_frozen_startup_heap_freezes_for_the_block_and_collects_first():
    class Cycle:
        pass

    garbage = Cycle()
    garbage.me = garbage  # cyclic garbage made before the block: collected, not kept frozen
    del garbage
    with frozen_startup_heap():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    # had the cycle been frozen instead of collected, unfreezing would have put it back in the oldest generation
    assert not any(type(o) is Cycle for o in gc.get_objects())
    with pytest.raises(RuntimeError), frozen_startup_heap():  # unfrozen on an error too
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def test_overlapping_blocks_keep_the_settings_until_the_last_ends():
    """Two servers in one process that stop in the order they started: the second keeps its frozen heap and its
    threshold until it stops too."""
    from contextlib import ExitStack

    old = gc.get_threshold()
    first, second = ExitStack(), ExitStack()
    for stack in (first, second):
        stack.enter_context(frozen_startup_heap())
        stack.enter_context(fewer_gc_passes())
    first.close()
    assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] >= 50_000
    second.close()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == old


def test_server_lifespan_freezes_its_startup_heap_and_raises_the_young_threshold(tiny_model_dir):
    from fastapi.testclient import TestClient

    from fxrewrite.runtime.engine.llm_engine import LLMEngine
    from fxrewrite.runtime.server.api_server import build_app

    engine = LLMEngine.from_kwargs(model=str(tiny_model_dir("qwen3")), device="cpu", load_format="dummy",
                                   max_model_len=64, kv_cache_memory_bytes=1 << 20)
    old = gc.get_threshold()
    with TestClient(build_app(engine)) as client:
        assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] >= 50_000
        response = client.post("/v1/completions", json={"model": str(engine.model_config.model), "prompt": "hi",
                                                        "max_tokens": 2})
        assert response.status_code == 200, response.text
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == old
