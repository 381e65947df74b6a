"""What the server's handlers read of a request after each step: cumulative snapshots, joined from DELTA outputs.

The engine sends the server's requests' outputs as `RequestOutputKind.DELTA` (only what is new); `OutputJoiner`
appends each to the request's own lists and hands out a `StepOutput` whose token ids and logprobs are
`PrefixView`s of those lists, and whose text is read from one `TextPieces` per choice. A step then costs O(new tokens), not O(tokens so far): with cumulative outputs (copied
in the engine, then again here) 256 streams of ~4.1k tokens took 19.0 ms of host work a step, with deltas joined
here 3.2 (`python -m fxrewrite.benchmarks.host_step --workloads stream,cumulative --warmup 4000`, BENCHMARKS.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fxrewrite.runtime.engine.text_pieces import TextPieces

if TYPE_CHECKING:
    from fxrewrite.runtime.engine.outputs import RequestOutput


class PrefixView(Sequence):
    """The first `n` items of a list that is only ever appended to, read in place: a snapshot taken now keeps
    showing these n items while the list grows. Indexing, slicing (a list), iteration, len, == with sequences."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int):
        self._items, self._n = items, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._items[slice(*index.indices(self._n))]
        if index < 0:
            index += self._n
        if not 0 <= index < self._n:
            raise IndexError(f"index {index} out of range for {self._n} items")
        return self._items[index]

    def __iter__(self):
        return itertools.islice(self._items, self._n)

    def __eq__(self, other) -> bool:
        if not isinstance(other, (PrefixView, list, tuple)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None

    def __repr__(self) -> str:
        return f"PrefixView({list(self)!r})"


@dataclass(frozen=True)
class ChoiceSnapshot:
    """One choice after a step. `source` holds its text: a str, or the choice's `TextPieces`, which later steps
    append to (this snapshot reads its first `text_len` characters: `text`, or `text_slice` for a part without
    joining the rest)."""

    index: int
    source: str | TextPieces
    token_ids: Sequence[int]
    logprobs: Sequence[dict] | None
    finish_reason: str | None
    stop_reason: int | str | None
    cumulative_logprob: float | None = None
    text_len: int = -1
    """Characters of `source` in this snapshot (-1: all of it now)."""

    def __post_init__(self):
        if self.text_len < 0:
            object.__setattr__(self, "text_len", len(self.source) if isinstance(self.source, str) else self.source.length)

    @property
    def text(self) -> str:
        return self.text_slice(0, self.text_len)

    def text_slice(self, start: int, end: int) -> str:
        """text[start:end], 0 <= start <= end <= text_len."""
        return self.source[start:end] if isinstance(self.source, str) else self.source.slice(start, end)


@dataclass(frozen=True)
class StepOutput:
    """One request's state right after a step: cumulative text, token ids and logprobs."""

    request_id: str
    num_prompt_tokens: int
    choices: tuple[ChoiceSnapshot, ...]
    finished: bool
    num_cached_tokens: int = 0
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs: tuple | None = None
    embedding: tuple[float, ...] | None = None
    """A pooling request's embedding, once finished (runner='pooling')."""

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


class _Choice:
    __slots__ = ("text", "token_ids", "logprobs")

    def __init__(self) -> None:
        self.text, self.token_ids, self.logprobs = TextPieces(), [], None


class _Joined:
    """One request's outputs so far (a DELTA stream, or a FINAL_ONLY request's one output)."""

    def __init__(self, output: RequestOutput):
        self.prompt_token_ids = tuple(output.prompt_token_ids)
        self.prompt_logprobs: tuple | None = None
        self.choices: dict[int, _Choice] = {}

    def add(self, output: RequestOutput) -> StepOutput:
        if output.prompt_logprobs is not None:  # sent once
            self.prompt_logprobs = tuple(output.prompt_logprobs)
        snapshots = []
        for c in output.outputs:
            joined = self.choices.get(c.index)
            if joined is None:
                joined = self.choices[c.index] = _Choice()
            joined.text.append(c.text)
            joined.token_ids += c.token_ids
            if c.logprobs is not None:
                if joined.logprobs is None:
                    joined.logprobs = []
                joined.logprobs += c.logprobs
            n = len(joined.token_ids)
            snapshots.append(ChoiceSnapshot(
                c.index, joined.text, PrefixView(joined.token_ids, n),
                PrefixView(joined.logprobs, len(joined.logprobs)) if joined.logprobs is not None else None,
                c.finish_reason, c.stop_reason, c.cumulative_logprob, joined.text.length))
        cached = int((output.metrics or {}).get("num_cached_tokens", 0) or 0)
        return StepOutput(output.request_id, len(self.prompt_token_ids), tuple(snapshots), bool(output.finished),
                          cached, self.prompt_token_ids, self.prompt_logprobs)


class OutputJoiner:
    """Cumulative `StepOutput`s from the engine's DELTA (or FINAL_ONLY) outputs, per request id."""

    def __init__(self) -> None:
        self._requests: dict[str, _Joined] = {}

    def snapshot(self, output: RequestOutput) -> StepOutput:
        if not isinstance(output.outputs, list):  # an EmbeddingRequestOutput (runtime/engine/pooling.py): once
            embedding = tuple(output.outputs.embedding) if output.outputs is not None else None
            return StepOutput(output.request_id, len(output.prompt_token_ids), (), bool(output.finished),
                              prompt_token_ids=tuple(output.prompt_token_ids), embedding=embedding)
        joined = self._requests.get(output.request_id)
        if joined is None:
            joined = self._requests[output.request_id] = _Joined(output)
        step = joined.add(output)
        if output.finished:
            del self._requests[output.request_id]
        return step

    def forget(self, request_id: str) -> None:
        """Drop a request's state (aborted or failed: no more outputs come)."""
        self._requests.pop(request_id, None)

    def forget_all(self) -> None:
        self._requests.clear()
