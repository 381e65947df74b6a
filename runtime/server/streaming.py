"""Streaming helpers: server-sent events, text deltas of cumulative outputs, merging request streams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from fxrewrite.runtime.server.errors import ClientDisconnected, OpenAIError, error_body

if TYPE_CHECKING:
    from fxrewrite.runtime.server.async_engine import ChoiceSnapshot, StepOutput

T = TypeVar("T")


def sse(payload: str) -> str:
    """One server-sent event carrying `payload` (JSON or [DONE])."""
    return f"data: {payload}\n\n"


def sse_error(error: BaseException) -> str:
    """The event that reports an error mid-stream (the openai client raises APIError on it)."""
    if isinstance(error, OpenAIError):
        body = error_body(error.status, error.message, error.param, error.code)
    else:
        body = error_body(500, f"{type(error).__name__}: {error}", None, "internal_error")
    return sse(json.dumps(body))


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that calls `on_close` however it ends.

    The events generator's own `finally` does not run when the client leaves before the first
    event is sent (the generator never started); `on_close` still does, so requests get aborted.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


@dataclass
class ChoiceDelta:
    """What is new in one choice since the last event: text[start:end] and tokens[tok_start:tok_end]."""

    prompt_index: int
    choice: ChoiceSnapshot
    text: str
    text_start: int
    tok_start: int
    tok_end: int
    is_first: bool
    finished: bool


class DeltaTracker:
    """Turns cumulative outputs into per-choice deltas, holding back `holdback` characters until done (0 for
    engine outputs: `LLMEngine` already holds back what could still become a stop string)."""

    def __init__(self, holdback: int = 0):
        self.holdback = holdback
        self._sent_chars: dict[tuple[int, int], int] = {}
        self._sent_tokens: dict[tuple[int, int], int] = {}
        self._done: set[tuple[int, int]] = set()

    def deltas(self, prompt_index: int, output: StepOutput) -> Iterator[ChoiceDelta]:
        """The deltas of `output` with new text, and each choice's last (finished) one, once."""
        for choice in output.choices:
            key = (prompt_index, choice.index)
            if key in self._done:
                continue
            finished = choice.finish_reason is not None
            is_first = key not in self._sent_chars
            start = self._sent_chars.get(key, 0)
            end = choice.text_len if finished else max(start, choice.text_len - self.holdback)
            tok_start = self._sent_tokens.get(key, 0)
            tok_end = len(choice.token_ids)
            if end == start and not finished:
                # No new text (the detokenizer holds a multi-byte character's first bytes, or a possible
                # stop string): send nothing; the tokens (and their logprobs) go out with the text they make.
                continue
            self._sent_chars[key] = end
            self._sent_tokens[key] = tok_end
            if finished:
                self._done.add(key)
            yield ChoiceDelta(prompt_index, choice, choice.text_slice(start, end), start, tok_start, tok_end,
                              is_first, finished)


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Yield (i, item) from all iterators as items arrive; cancels the rest when closed early."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    loop = asyncio.get_running_loop()
    pending = {loop.create_task(_anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                item = task.result()
                if item is _END:
                    continue
                yield i, item
                pending[loop.create_task(_anext(iterators[i]))] = i
    finally:
        for task in pending:
            task.cancel()


_END = object()


async def _anext(iterator: AsyncIterator[T]) -> Any:
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return _END


async def final_outputs(streams: list[AsyncIterator[StepOutput]]) -> list[StepOutput]:
    """The last (finished) output of each stream, in order."""
    last: list[StepOutput | None] = [None] * len(streams)
    async for i, output in merge_async_iterators(*streams):
        last[i] = output
    return [o for o in last if o is not None]


async def cancel_on_disconnect(awaitable: Awaitable[T], raw_request: Request) -> T:
    """Await `awaitable`, cancelling it if the client disconnects first (then raise ClientDisconnected)."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(raw_request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not work.done():
        work.cancel()
        raise ClientDisconnected("client disconnected")
    return work.result()


async def _wait_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return
