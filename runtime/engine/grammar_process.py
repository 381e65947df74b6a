"""The grammar process: the constrained sequences' matchers, and every step's accept and fill, in a child
process, so the engine's main thread only sends the previous step's tokens and reads back a job id.

Why a process: at decode batch 64 on a small model the engine is host-bound (its main thread is busy the
whole step), so grammar work on that thread adds 1:1, and on a worker thread of the same process it costs
about as much through the GIL: xgrammar's calls release it, but the worker takes it back around every
call, and each hand-off stalls the main thread for two thread wake-ups (measured on the H200 host: 2
worker threads 18% slower than no grammar, the main thread alone 17%). A child process has its own GIL.
vLLM keeps the same work out of its API process for the same reason.

The masks go through shared memory: two slots of [rows, ceil(V/32)] int32 in a memfd, mapped by both
processes; the parent registers its mapping with CUDA (cudaHostRegister), so the copy of a filled slot to
the device is asynchronous like one from pinned memory. A slot is refilled only after its previous copy
ran (`MaskSlots`). The child is started with the Python running the engine, loads grammar_worker.py by
path, gets the tokenizer description (xgrammar's TokenizerInfo as JSON) through a second memfd, runs in
its own session (a terminal's Ctrl-C goes to the engine, which then closes the pipe) and exits when its
input pipe closes: at `close()`, when the manager is collected, or when the engine's process dies.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import pickle
import subprocess
import sys
import weakref

import torch

from fxrewrite.runtime.engine import grammar_worker
from fxrewrite.runtime.engine.grammar_worker import HEADER, write_message

logger = logging.getLogger(__name__)
_BOOT = ("import importlib.util as u, sys; s = u.spec_from_file_location('fxrewrite_grammar_worker', sys.argv[1]); "
         "m = u.module_from_spec(s); s.loader.exec_module(m); m.main(sys.argv[2:])")


class GrammarProcessGone(RuntimeError):
    """The grammar process exited, was killed or was closed: the matchers it held are lost (a job's own
    error, a token its grammar refuses, stays a plain RuntimeError)."""


def supported() -> bool:
    """Whether this platform can run the grammar process (Linux memfds)."""
    return hasattr(os, "memfd_create") and sys.platform.startswith("linux")


class GrammarProcess:
    """The parent's end: start the child, send matcher additions and step jobs, read the answers.

    Args:
        tokenizer_info_json: xgrammar's `TokenizerInfo.serialize_json()` of the engine's tokenizer.
        rows: the most rows a step's mask has (the engine's max_num_seqs).
        width: words per mask row (ceil(vocab_size / 32)).
    """

    def __init__(self, tokenizer_info_json: str, rows: int, width: int):
        self.rows, self.width = rows, width
        mask_fd = os.memfd_create("fxrewrite-grammar-masks")
        info_fd = os.memfd_create("fxrewrite-grammar-tokenizer")
        parent_read = child_write = child_read = parent_write = -1
        try:
            os.ftruncate(mask_fd, 2 * rows * width * 4)
            os.write(info_fd, tokenizer_info_json.encode())
            os.lseek(info_fd, 0, os.SEEK_SET)
            child_read, parent_write = os.pipe()
            parent_read, child_write = os.pipe()
            fds = (child_read, child_write, mask_fd, info_fd)
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, grammar_worker.__file__, *map(str, fds), str(rows), str(width)],
                pass_fds=fds, start_new_session=True, stdin=subprocess.DEVNULL)
            self._buffer = mmap.mmap(mask_fd, 2 * rows * width * 4)
        finally:
            for fd in (child_read, child_write, mask_fd, info_fd):
                if fd >= 0:
                    os.close(fd)
        self._rfd, self._wfd = parent_read, parent_write
        self.slots = torch.frombuffer(self._buffer, dtype=torch.int32).view(2, rows, width)
        """The two shared mask slots [2, rows, width] int32 (written by the child, read here)."""
        self._registered: list[int] = []  # data_ptr registered with CUDA (unregistered at close)
        self._ready = False
        self._next_id = 0
        self._pending: collections.deque[int] = collections.deque()
        self._inbox = bytearray()  # bytes read from the child, not yet a whole answer
        self.error: str | None = None
        """Why the process is unusable (it exited, a pipe broke), or None."""
        self._finalizer = weakref.finalize(self, _shutdown, self._proc, self._rfd, self._wfd, self._registered)

    def pin(self) -> None:
        """Register the shared slots with CUDA (once), so their copies to the device do not wait."""
        if not self._registered and torch.cuda.is_available():
            ptr = self.slots.data_ptr()
            code = int(torch.cuda.cudart().cudaHostRegister(ptr, self.slots.numel() * 4, 0))
            if code == 0:
                self._registered.append(ptr)
            else:  # still correct: torch then copies from pageable memory, waiting for the copy
                logger.warning("cudaHostRegister of the grammar masks' shared memory failed (cudaError %d): "
                               "each mask's copy to the device will wait", code)

    def add(self, seq_id: int, spec: tuple) -> None:
        """Make `seq_id`'s matcher in the child (compiled there from `spec`, cached by xgrammar)."""
        self._send(("add", seq_id, spec))

    def remove(self, seq_id: int) -> None:
        self._send(("remove", seq_id))

    def submit(self, accept_ids: list[int], tokens: list[int], fill_ids: list[int] | None, skip, slot: int) -> int:
        """Send a step's job (see grammar_worker's protocol); returns its id for `result`."""
        job_id = self._next_id
        self._next_id += 1
        self._send(("job", job_id, accept_ids, tokens, fill_ids, skip, slot))
        self._pending.append(job_id)
        return job_id

    def result(self, job_id: int) -> tuple[float, float, float]:
        """Wait for job `job_id`; (seconds accepting, filling, the child's job time). Answers of earlier
        jobs nobody waited for (a step that failed) are read and dropped. RuntimeError: the job's error;
        GrammarProcessGone: the process is gone."""
        if job_id not in self._pending:
            raise RuntimeError(f"grammar job {job_id} was never submitted or was already read")
        while True:
            answer = self._receive()
            if answer[0] == "ready":
                self._ready = True
                continue
            done = self._pending.popleft()
            if done == job_id:
                _, error, accept_s, fill_s, job_s = answer
                if error is not None:
                    raise RuntimeError(error)
                return accept_s, fill_s, job_s

    def alive(self) -> bool:
        """Whether the child is running and its pipes work (False once it exited, was killed, or was closed)."""
        return self.error is None and self._proc.poll() is None

    def why_gone(self) -> str:
        """Why the process is unusable (`alive()` is False): its error, or its exit code."""
        return self.error or f"the grammar process exited (exit code {self._proc.poll()})"

    def close(self) -> None:
        """End the child (it exits when its input closes) and unregister the shared slots."""
        if self.error is None:
            self.error = "the grammar process was closed"  # its pipes' fd numbers may be reused now
        self._finalizer()

    def _send(self, message) -> None:
        self._check()
        try:
            write_message(self._wfd, message)
        except OSError as e:
            self._fail(f"the grammar process is gone ({e})")

    def _receive(self):
        """The child's next answer: one read() for header and body together in practice."""
        self._check()
        inbox, size = self._inbox, HEADER.size
        try:
            while len(inbox) < size or len(inbox) < size + HEADER.unpack_from(inbox)[0]:
                chunk = os.read(self._rfd, 1 << 16)
                if not chunk:
                    raise EOFError("the other end of the grammar pipe closed")
                inbox += chunk
        except (EOFError, OSError) as e:
            self._fail(f"the grammar process is gone ({e})")
        end = size + HEADER.unpack_from(inbox)[0]
        answer = pickle.loads(inbox[size:end])
        del inbox[:end]
        return answer

    def _check(self) -> None:
        if self.error is not None:
            raise GrammarProcessGone(self.error)

    def _fail(self, message: str) -> None:
        code = self._proc.poll()
        self.error = message + (f"; exit code {code}" if code is not None else "")
        self.close()
        raise GrammarProcessGone(self.error)


def _shutdown(proc: subprocess.Popen, rfd: int, wfd: int, registered: list[int]) -> None:
    for fd in (wfd, rfd):
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    while registered:
        try:
            torch.cuda.cudart().cudaHostUnregister(registered.pop())
        except Exception:  # noqa: BLE001 - CUDA may be torn down at interpreter exit
            pass
