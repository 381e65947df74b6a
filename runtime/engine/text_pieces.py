"""Text that grows a piece at a time and is read mostly at its end (a sequence's detokenized output).

`s += piece` on an attribute or a list item copies the whole string: O(length) a token; for 256 sequences a step
0.13 / 0.58 ms at 16 / 64 kB of text on a 2-core EPYC (benchmarks/results/2026-12-05-text-append-copy-thirty-ninth.log).
`TextPieces` keeps the recent pieces in a list and joins them into its head every `JOIN_EVERY` appends or when the
whole text is read, so an append costs O(length / JOIN_EVERY) and reading the tail (stop-string search, DELTA
outputs, streamed deltas) costs O(tail).
"""

from __future__ import annotations

__all__ = ["TextPieces"]

JOIN_EVERY = 64


class TextPieces:
    """Append-only text (plus `set`, which replaces it). `length` is len(text) without joining anything."""

    __slots__ = ("_head", "_pieces", "length")

    def __init__(self, text: str = ""):
        self._head, self._pieces, self.length = text, [], len(text)

    def append(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self.length += len(piece)
            if len(self._pieces) >= JOIN_EVERY:
                self._join()

    def set(self, text: str) -> None:
        self._head, self._pieces, self.length = text, [], len(text)

    def text(self) -> str:
        """The whole text (joins the pending pieces once)."""
        if self._pieces:
            self._join()
        return self._head

    def slice(self, start: int, end: int | None = None) -> str:
        """text[start:end] for 0 <= start, reading only the pieces the range reaches when it starts after the head."""
        head = len(self._head)
        if start >= head:
            tail = "".join(self._pieces)
            return tail[start - head:] if end is None else tail[start - head:end - head]
        if end is None or end > head:
            self._join()
        return self._head[start:end]

    def _join(self) -> None:
        self._head += "".join(self._pieces)
        self._pieces.clear()
