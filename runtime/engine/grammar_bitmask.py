"""The host side of structured outputs' token bitmasks: two host mask slots used in turn, and their copy to
the device without waiting (`MaskSlots`); a started step's grammar job (`GrammarJob`); the stat keys.

The slots are pinned host tensors when the grammar work runs in the engine's process, or the grammar
process's shared memory (grammar_process.py; registered with CUDA, so the copy is asynchronous too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

STAT_KEYS = ("accept_s", "fill_s", "job_s", "main_s", "wait_s", "tokens_wait_s", "complete_s", "steps")
"""Seconds: accepting / filling (where the matchers live), the grammar process's whole job (`job_s`), the
main thread's time in the grammar calls (`main_s`), of which blocked on the job's answer (`wait_s`), its
wait for the previous step's token ids before starting the job (`tokens_wait_s`) and its completion of
that step while the job ran (`complete_s`); `steps`: the number of masks filled."""


@dataclass
class GrammarJob:
    """A step's grammar work in the grammar process, started by `StructuredOutputManager.start_step`."""

    job_id: int
    slot: int
    host: torch.Tensor | None
    """The slot's rows being filled; None when the job fills no mask."""
    event: object = None
    grammar_done: set[int] = field(default_factory=set)
    """seq_ids whose accepted token completes their grammar (a stop token)."""
    process: object = None
    """The GrammarProcess running the job; None when it was gone before the job could be sent."""


class MaskSlots:
    """Two host mask slots used in turn, each with the CUDA event of its last copy to the device: a slot
    is refilled only after that copy ran, without a device sync; two reused device buffers.

    Args:
        width: words per row (ceil(vocab_size / 32)).
        shared: None (pinned slots, grown as needed), or the grammar process's slots [2, rows, width].
        pin: called once before the first copy from `shared` to a CUDA device (registers it with CUDA).
    """

    def __init__(self, width: int, shared: torch.Tensor | None = None, pin: Callable[[], None] | None = None):
        self.width = width
        self._shared, self._pin = shared, pin
        self._host: list[torch.Tensor | None] = [None, None] if shared is None else [shared[0], shared[1]]
        self._events: list = [None, None]
        self._views: list[tuple[int, torch.Tensor] | None] = [None, None]  # (rows, host[:rows]) last handed out
        self._turn = 0
        self._copy_stream = None
        self._device_slots: list = [None, None]
        self._device_turn = 0
        self._used = None
        self._retired: list[torch.Tensor] = []

    def next(self, rows: int, device: torch.device) -> tuple[int, torch.Tensor, object]:
        """(slot index, its first `rows` rows, its CUDA event or None), once its previous copy ran."""
        slot = self._turn
        self._turn ^= 1
        host = self._host[slot]
        if host is None or host.shape[0] < rows:
            if self._shared is not None:
                raise RuntimeError(f"a step samples {rows} sequences, more than the grammar process's "
                                   f"{host.shape[0]} mask rows (max_num_seqs)")
            with torch.inference_mode(False):  # a normal tensor: refilled in place in and out of inference mode
                host = self._host[slot] = torch.empty((max(rows, 64), self.width), dtype=torch.int32,
                                                      pin_memory=device.type == "cuda")
            self._views[slot] = None
        if device.type == "cuda":
            if self._pin is not None:
                self._pin()
                self._pin = None
            if self._events[slot] is None:
                self._events[slot] = torch.cuda.Event()
            else:
                self._events[slot].synchronize()  # its previous copy was queued two masks ago: done in practice
        view = self._views[slot]
        if view is None or view[0] != rows:  # a slice costs microseconds; the batch rarely changes size
            view = self._views[slot] = (rows, host[:rows])
        return slot, view[1], self._events[slot]

    def to_device(self, host: torch.Tensor | None, event, device: torch.device) -> torch.Tensor | None:
        """`host` copied into one of two reused device buffers on a side stream, without waiting (CPU:
        `host` itself). The copy overlaps the forward pass still running on the compute stream, which only
        waits for it before the sampler that reads the mask (stream-ordered, no host sync)."""
        if host is None or device.type != "cuda":
            return host
        compute = torch.cuda.current_stream(device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
            self._used = torch.cuda.Event()
            self._used.record(compute)
        slot = self._device_turn
        self._device_turn ^= 1
        rows, buffer = host.shape[0], self._device_slots[slot]
        if buffer is None or buffer.shape[0] < rows:
            if buffer is not None:
                self._retired.append(buffer)  # a pending kernel may still read it: never freed
            with torch.inference_mode(False):
                buffer = torch.empty((max(rows, 64, 2 * (0 if buffer is None else buffer.shape[0])), host.shape[1]),
                                     dtype=torch.int32, device=device)
            self._device_slots[slot] = buffer
        # This buffer's last reader is the sampler launched two masks ago, before `_used` was recorded.
        self._copy_stream.wait_event(self._used)
        out = buffer[:rows]
        with torch.cuda.stream(self._copy_stream):
            out.copy_(host, non_blocking=True)
            event.record(self._copy_stream)  # the host slot's reuse waits for this
        self._used.record(compute)  # every sampler launched so far (the other buffer's reader included)
        compute.wait_event(event)
        return out
