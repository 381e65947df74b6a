"""`ShmQueue`: order, wrap-around, messages larger than a chunk, several readers, and a reader that
notices its writer's death (and a writer its reader's)."""

import hashlib
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

from fxrewrite.runtime.worker.shm_queue import PeerDiedError, ShmQueue

_SPAWN = multiprocessing.get_context("spawn")


def _read_all(handle, reader, out):
    """Reader process: sends back everything it got until None (arrays as `_digest`)."""
    q = ShmQueue.attach(handle, reader=reader)
    got = []
    while (msg := q.get(timeout=60)) is not None:
        got.append(_digest(msg) if isinstance(msg, np.ndarray) else msg)
    q.close()
    out.put((reader, got))


def _write_then_die(handle, ready):
    q = ShmQueue.attach(handle, reader=None)
    q.put("first")
    ready.set()
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def _digest(a: np.ndarray) -> tuple[str, str, tuple]:
    """An array's identity without sending it back: sha256 of its bytes, its dtype and shape."""
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest(), a.dtype.str, a.shape


def _expected(msgs):
    return [_digest(m) if isinstance(m, np.ndarray) else m for m in msgs]


def test_in_process_order_and_wrap_around():
    writer = ShmQueue.create(1, n_chunks=3, chunk_bytes=256)
    reader = ShmQueue.attach(writer.handle, reader=0)
    try:
        for round_ in range(10):  # 20 messages through a ring of 3: wraps around several times
            writer.put(("a", round_))
            writer.put({"b": [round_] * 5})
            assert reader.get(timeout=5) == ("a", round_)
            assert reader.get(timeout=5) == {"b": [round_] * 5}
    finally:
        reader.close()
        writer.close()


def test_writer_waits_for_a_reader_that_is_behind():
    writer = ShmQueue.create(1, n_chunks=2, chunk_bytes=128)
    reader = ShmQueue.attach(writer.handle, reader=0)
    try:
        writer.put(1)
        writer.put(2)
        with pytest.raises(TimeoutError, match="readers behind"):
            writer.put(3, timeout=0.05)  # both chunks unread: the ring is full
        assert reader.get(timeout=5) == 1
        writer.put(3, timeout=5)
        assert [reader.get(timeout=5), reader.get(timeout=5)] == [2, 3]
    finally:
        reader.close()
        writer.close()


def test_two_reader_processes_see_every_message_in_order_including_large_ones():
    writer = ShmQueue.create(2, n_chunks=4, chunk_bytes=4096)
    out = _SPAWN.Queue()
    procs = [_SPAWN.Process(target=_read_all, args=(writer.handle, r, out)) for r in range(2)]
    for p in procs:
        p.start()
    rng = np.random.default_rng(0)
    # Small ones, then arrays of 40 KB and 800 KB: 10 and 200 chunks streamed through a ring of 4.
    msgs = list(range(30)) + [rng.integers(0, 1000, 5000), "mid", rng.integers(0, 1000, 100_000), "end",
                              rng.standard_normal((300, 70)).astype(np.float32)]  # 84 KB, 2-D, float32
    try:
        for m in msgs:
            writer.put(m, timeout=60)
        writer.put(None, timeout=60)
        results = dict(out.get(timeout=60) for _ in procs)
        assert results == {0: _expected(msgs), 1: _expected(msgs)}
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        writer.close()


def test_reader_sees_writer_death():
    owner = ShmQueue.create(1, n_chunks=4, chunk_bytes=256, reader=0)
    ready = _SPAWN.Event()
    proc = _SPAWN.Process(target=_write_then_die, args=(owner.handle, ready))
    proc.start()
    try:
        assert ready.wait(60)
        assert owner.get(timeout=5) == "first"
        start = time.monotonic()
        # The writer is our child: once dead it is a zombie (its pid still exists), so watch the process.
        owner.is_alive = proc.is_alive
        with pytest.raises(PeerDiedError, match="peer process is gone"):
            owner.get(timeout=60)
        assert time.monotonic() - start < 10
    finally:
        proc.join(10)
        owner.close()


def test_default_liveness_watches_the_writer_pid():
    writer = ShmQueue.create(1, n_chunks=2, chunk_bytes=128)
    reader = ShmQueue.attach(writer.handle, reader=0)
    try:
        proc = _SPAWN.Process(target=time.sleep, args=(0,))
        proc.start()
        proc.join()  # reaped: its pid no longer exists
        writer._buf[:8] = proc.pid.to_bytes(8, "little")  # as if that process had been the writer
        with pytest.raises(PeerDiedError):
            reader.get(timeout=5)
    finally:
        reader.close()
        writer.close()


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_readers=0"):
        ShmQueue.create(0)
    writer = ShmQueue.create(2, n_chunks=2, chunk_bytes=128)
    try:
        with pytest.raises(ValueError, match=r"reader=2 must be in \[0, 2\)"):
            ShmQueue.attach(writer.handle, reader=2)
    finally:
        writer.close()
