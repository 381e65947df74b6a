"""The full-batch decode window of a throughput run: output tokens per second over the first N engine steps
after every request has its first token and before any request finishes.

Why: the nano-vllm workload's figure (output tokens over the whole run) needs the whole prefill of 256
prompts (~143k tokens) first. An arm as slow as transformers' eager experts loop (the MoE `before`
arm: ~2 s per step on an H200, 2026-12-01-qwen3-30b-a3b-throughput.json) is cut by any bounded time
limit while still in prefill, so its figure and the after/before ratio measure prefill progress, not
serving speed. The window is measured the same way in every arm: the same requests, all of them running
(none finished, none waiting for a prefill), so every arm decodes the same batch. The window stops
early at the first finished request (the batch would shrink); `steps` says how many it covered.

`bench compare --decode-window N` makes the window the headline (``headline_key``) and stops each arm
once its window is measured (or at --time-limit); without it the window is still reported when a run
reaches it.
"""

from __future__ import annotations

__all__ = ["DecodeWindow"]


class DecodeWindow:
    """Track one run's window; `update` after each engine step, `result()` at the end.

    steps: the window's length in engine steps (>= 1); the run may stop once `complete`."""

    def __init__(self, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"decode window steps={steps}, expected >= 1")
        self.steps = steps
        self.start: tuple[float, int] | None = None  # (seconds, output tokens) when the last prefill finished
        self.end: tuple[float, int] | None = None
        self.covered = 0
        self.batch = 0
        self.complete = False

    def update(self, now: float, counts: dict, num_finished: int) -> bool:
        """After a step at `now` seconds: `counts` maps every request to its output tokens so far,
        `num_finished` requests are done. Returns whether the window is complete."""
        if self.complete:
            return True
        total = sum(counts.values())
        if self.start is None:
            if num_finished == 0 and all(counts.values()):  # every prefill done, the whole batch running
                self.start, self.batch = (now, total), len(counts)
            return False
        self.end, self.covered = (now, total), self.covered + 1
        # the step that finishes a request still decoded the whole batch: counted, then the window closes
        self.complete = num_finished > 0 or self.covered >= self.steps
        return self.complete

    def result(self) -> dict:
        """{"steps", "batch", "output_tokens", "seconds", "output_tokens_per_s"}; the rate is None (with
        a "reason") when the run never reached a decode step with every request running."""
        if self.start is None or self.end is None:
            return {"steps": 0, "batch": self.batch, "output_tokens_per_s": None,
                    "reason": "no step decoded every request: the run ended with some still in prefill, or "
                              "a request finished before the last one had its first token"}
        seconds, tokens = self.end[0] - self.start[0], self.end[1] - self.start[1]
        return {"steps": self.covered, "batch": self.batch, "output_tokens": tokens, "seconds": round(seconds, 4),
                "output_tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None}
