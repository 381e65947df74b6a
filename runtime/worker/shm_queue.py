"""A one-writer, N-reader message queue in shared memory, for processes of one host.

The driver -> workers step broadcast and TP rank 0 -> driver sampled tokens go through it instead of
gloo (a gloo round trip costs milliseconds per step; this costs tens of microseconds). The design
follows vLLM's ``shm_broadcast.MessageQueue``: a ring of fixed-size chunks in one
`multiprocessing.shared_memory` segment, each chunk with a "written" flag and one "read" flag per
reader. The writer fills chunk i once every reader has read its previous message (or it was never
written), clears the read flags, then sets "written"; reader r takes chunk i once it is written and
its own read flag is clear, then sets that flag. Waiting spins (yielding the CPU and the GIL) for a
while, then sleeps in short naps, so an idle engine does not burn a core.

A message larger than a chunk is streamed through consecutive chunks (each chunk says whether more
follow), so there is no side channel to manage; the writer only blocks while the readers are behind.

Liveness: every wait calls `is_alive()` about once a millisecond and raises `PeerDiedError` when it
returns False (default: the peer process id recorded in the segment still exists), and `TimeoutError`
after `timeout` seconds.

Layout: [header 16 B: writer pid (int64), n_readers (int64)] [flags: n_chunks x (1 + n_readers) B]
[data: n_chunks x chunk_bytes]; a chunk's data starts with its payload length (uint32) and a
"more follows" byte.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import struct
import sys
import threading
import time
from multiprocessing import resource_tracker, shared_memory

_HEADER = struct.Struct("<qq")
_CHUNK_HEADER = struct.Struct("<IB")
SPIN_S = 0.05
"""Spin (yielding) this long before napping: a decode step is a few milliseconds."""
NAP_S = (5e-5, 1e-3)
"""Naps while waiting double from the first to the longest (few wake-ups when idle or oversubscribed)."""
CHECK_EVERY_S = 1e-3
_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier (a lock round trip): data before flags, flags before data, on any CPU."""
    _fence_lock.acquire()
    _fence_lock.release()


class PeerDiedError(RuntimeError):
    """The process at the other end of a `ShmQueue` is gone (or `is_alive()` said so)."""


@dataclasses.dataclass(frozen=True)
class QueueHandle:
    """What a reader needs to attach (picklable): segment name, sizes, and the peer to watch."""

    name: str
    n_readers: int
    n_chunks: int
    chunk_bytes: int


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _attach(name: str) -> shared_memory.SharedMemory:
    """Open an existing segment without registering it with the resource tracker (its creator owns
    it; a tracked attach would unlink it when this process exits)."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name, track=False)
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return shared_memory.SharedMemory(name)
    finally:
        resource_tracker.register = register


class ShmQueue:
    """One end of the queue: `ShmQueue.create(...)` makes the segment (the owner unlinks it on `close`),
    `ShmQueue.attach(handle, reader=r)` opens it as reader r, or as the writer with reader=None.

    `put(obj)` (writer) pickles and sends; `get()` (reader) returns the next object in order.
    `is_alive`: a callable polled while waiting (default: the peer's pid still exists: for a reader the
    writer pid in the segment, for a writer nothing). `spin_s`: how long a wait spins before napping
    (0 where the processes outnumber the cores: a spinning process would take a core from a busy one).
    Raises PeerDiedError / TimeoutError.
    """

    def __init__(self, shm, handle: QueueHandle, reader: int | None, owner: bool, is_alive=None,
                 spin_s: float = SPIN_S):
        self._shm, self.handle, self.reader, self._owner = shm, handle, reader, owner
        self._buf = shm.buf
        self._stride = 1 + handle.n_readers
        self._flags_at = _HEADER.size
        self._data_at = _HEADER.size + handle.n_chunks * self._stride
        self._index = 0
        self.is_alive, self.spin_s = is_alive, spin_s
        if reader is None:  # the writer records itself for the readers' default liveness check
            _HEADER.pack_into(self._buf, 0, os.getpid(), handle.n_readers)

    @classmethod
    def create(cls, n_readers: int, n_chunks: int = 16, chunk_bytes: int = 256 * 1024, reader: int | None = None,
               is_alive=None, spin_s: float = SPIN_S) -> ShmQueue:
        """Make the segment (zeroed flags); this end is the writer (reader None) or reader `reader`."""
        if n_readers < 1 or n_chunks < 2 or chunk_bytes <= _CHUNK_HEADER.size:
            raise ValueError(f"bad queue shape: n_readers={n_readers}, n_chunks={n_chunks}, chunk_bytes={chunk_bytes}")
        size = _HEADER.size + n_chunks * (1 + n_readers) + n_chunks * chunk_bytes
        shm = shared_memory.SharedMemory(create=True, size=size)
        shm.buf[:_HEADER.size + n_chunks * (1 + n_readers)] = bytes(_HEADER.size + n_chunks * (1 + n_readers))
        handle = QueueHandle(shm.name, n_readers, n_chunks, chunk_bytes)
        return cls(shm, handle, reader, owner=True, is_alive=is_alive, spin_s=spin_s)

    @classmethod
    def attach(cls, handle: QueueHandle, reader: int | None, is_alive=None, spin_s: float = SPIN_S) -> ShmQueue:
        """Open `handle`'s segment as reader `reader` (0 .. n_readers-1) or as the writer (None)."""
        if reader is not None and not 0 <= reader < handle.n_readers:
            raise ValueError(f"reader={reader} must be in [0, {handle.n_readers})")
        return cls(_attach(handle.name), handle, reader, owner=False, is_alive=is_alive, spin_s=spin_s)

    def _flag(self, chunk: int, slot: int) -> int:
        return self._flags_at + chunk * self._stride + slot

    def _wait(self, ready, timeout: float | None, what: str) -> None:
        """Spin, then nap, until ready(); poll liveness about every CHECK_EVERY_S."""
        if ready():
            return
        start = last_check = time.monotonic()
        nap = NAP_S[0]
        while not ready():
            now = time.monotonic()
            if now - last_check > CHECK_EVERY_S:
                last_check = now
                self._check_peer(what)
                if timeout is not None and now - start > timeout:
                    raise TimeoutError(f"shared-memory queue: no progress within {timeout:.0f} s ({what})")
            idle = now - start
            if idle < self.spin_s:
                os.sched_yield()  # releases the GIL, so the process's other threads run
            else:
                time.sleep(nap)
                nap = min(2 * nap, NAP_S[1])

    def _check_peer(self, what: str) -> None:
        if self.is_alive is not None:
            alive = self.is_alive()
        elif self.reader is not None:
            alive = _pid_alive(_HEADER.unpack_from(self._buf, 0)[0])
        else:
            alive = True
        if not alive:
            raise PeerDiedError(f"shared-memory queue: the peer process is gone ({what})")

    def put(self, obj, timeout: float | None = None) -> None:
        """Pickle `obj` and write it to the ring (streamed over several chunks when large)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        room = self.handle.chunk_bytes - _CHUNK_HEADER.size
        view = memoryview(data)
        for at in range(0, max(len(data), 1), room):
            self._put_chunk(view[at:at + room], more=at + room < len(data), timeout=timeout)

    def _put_chunk(self, part, more: bool, timeout: float | None) -> None:
        buf, chunk, n = self._buf, self._index, self.handle.n_readers
        written = self._flag(chunk, 0)
        reads = slice(written + 1, written + 1 + n)
        self._wait(lambda: buf[written] == 0 or sum(buf[reads]) == n, timeout, "readers behind")
        buf[written] = 0
        at = self._data_at + chunk * self.handle.chunk_bytes
        _CHUNK_HEADER.pack_into(buf, at, len(part), more)
        buf[at + _CHUNK_HEADER.size:at + _CHUNK_HEADER.size + len(part)] = part
        _fence()
        buf[reads] = bytes(n)
        _fence()
        buf[written] = 1
        self._index = (chunk + 1) % self.handle.n_chunks

    def get(self, timeout: float | None = None):
        """The next object (blocks; PeerDiedError when the writer dies meanwhile)."""
        parts = []
        more = True
        while more:
            part, more = self._get_chunk(timeout)
            parts.append(part)
        return pickle.loads(parts[0] if len(parts) == 1 else b"".join(parts))

    def _get_chunk(self, timeout: float | None) -> tuple[bytes, bool]:
        buf, chunk = self._buf, self._index
        written = self._flag(chunk, 0)
        mine = written + 1 + self.reader
        self._wait(lambda: buf[written] == 1 and buf[mine] == 0, timeout, "waiting for the writer")
        _fence()
        at = self._data_at + chunk * self.handle.chunk_bytes
        size, more = _CHUNK_HEADER.unpack_from(buf, at)
        part = bytes(buf[at + _CHUNK_HEADER.size:at + _CHUNK_HEADER.size + size])
        _fence()
        buf[mine] = 1
        self._index = (chunk + 1) % self.handle.n_chunks
        return part, bool(more)

    def close(self) -> None:
        """Detach; the owner also removes the segment (idempotent)."""
        if self._shm is None:
            return
        self._buf = None
        self._shm.close()
        if self._owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
        self._shm = None
