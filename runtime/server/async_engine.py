"""An asyncio front for the synchronous `LLMEngine`: requests arrive while one background task steps.

Threading: `LLMEngine.step()` runs in a worker thread (so HTTP keeps being served during a step),
and every engine call (`add_request`, `abort_request`, `step`, `get_stats`) happens while
`_lock` is held, so the engine is never touched by two threads at once. The engine sends each request's outputs
as deltas (`RequestOutputKind.DELTA`); `OutputJoiner` appends them to the request's own lists in the event-loop
thread and hands out cumulative `StepOutput` snapshots that read those lists in place.

Per request, a `_Collector` keeps only the latest snapshot: outputs are cumulative, so a slow
reader skips intermediate ones instead of queueing them. Aborts (a client gone) are recorded
without awaiting, which is safe inside a cancelled generator's `finally`, and applied by the
background task before its next step; the request's KV blocks are freed then.

An exception from `step()` fails the requests in flight (each reader gets it) and the loop goes
on serving new requests, unless the engine then reports itself dead (`check_health`: a tensor-parallel
worker exited): then the requests in flight, and every later one, get `EngineDeadError` (a 503).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from fxrewrite.runtime.engine.sampling_params import RequestOutputKind, SamplingParams
from fxrewrite.runtime.server.errors import OpenAIError
from fxrewrite.runtime.server.step_outputs import ChoiceSnapshot, OutputJoiner, StepOutput

if TYPE_CHECKING:
    from fxrewrite.runtime.engine.llm_engine import LLMEngine
    from fxrewrite.runtime.server.metrics import ServerMetrics

__all__ = ["AsyncLLMEngine", "ChoiceSnapshot", "EngineDeadError", "StepOutput"]

logger = logging.getLogger(__name__)


class EngineDeadError(OpenAIError):
    """The background loop stopped or the engine died (a worker exited); no request can be served.
    An `OpenAIError`: the server answers 503 (`engine_dead`), mid-stream too."""

    def __init__(self, message: str):
        super().__init__(HTTPStatus.SERVICE_UNAVAILABLE, message, code="engine_dead")


class _Collector:
    """The latest output of one request, or the error that ended it."""

    def __init__(self, num_completions: int = 1) -> None:
        self.num_completions = num_completions
        """The request's completions (SamplingParams.n): `fxrewrite:request_aborted` counts those not in `recorded`
        (`fxrewrite:request_success` counts each finished one)."""
        self.recorded: set[int] = set()
        self._output: StepOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: StepOutput) -> None:
        self._output = output
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def get(self) -> StepOutput:
        await self._ready.wait()
        self._ready.clear()
        if self._error is not None:
            raise self._error
        output, self._output = self._output, None
        assert output is not None  # _ready is set only with an output or an error
        return output


class AsyncLLMEngine:
    """Serve many concurrent `generate()` calls from one `LLMEngine`.

    Start the loop with `start()` inside the running event loop (the app's lifespan) and stop it
    with `stop()`. `generate()` raises ValueError (from the engine) for a bad request.
    """

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics
        self._collectors: dict[str, _Collector] = {}
        self._joiner = OutputJoiner()
        self._pending_aborts: set[str] = set()
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.dead_error: BaseException | None = None
        self.request_logger = None
        """An object with log(request_id, prompt, params), called for each admitted request (or None)."""

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run_loop(), name="engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and self.dead_error is None

    # -- requests --------------------------------------------------------------------------
    async def add_request(
        self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams
    ) -> AsyncIterator[StepOutput]:
        """Admit a request and return the iterator of its cumulative outputs.

        Raises ValueError (from the engine) when the request is refused; nothing is held then.
        The iterator ends after the output with `finished` set; leaving it early aborts the
        request, and so does `abort(request_id)` (also needed when it is never iterated).
        """
        arrival = time.monotonic()
        collector = await self._add(request_id, prompt, sampling_params)
        return self._stream(request_id, collector, _LatencyTimer(self.metrics, arrival))

    async def generate(
        self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams
    ) -> AsyncIterator[StepOutput]:
        """`add_request` and iterate, in one call."""
        async for output in await self.add_request(request_id, prompt, sampling_params):
            yield output

    async def _stream(self, request_id: str, collector: _Collector, timer: _LatencyTimer
                      ) -> AsyncIterator[StepOutput]:
        finished = False
        try:
            while not finished:
                output = await collector.get()
                timer.observe(output)
                finished = output.finished
                if self.metrics is not None:
                    self._record_finished_choices(collector, output)
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def _record_finished_choices(self, collector: _Collector, output: StepOutput) -> None:
        """Count each choice in `fxrewrite:request_success` once, when it first shows a finish reason (with n > 1 a
        stream may deliver one finished while others run; an abort then counts only the others)."""
        for choice in output.choices:
            if (choice.finish_reason is not None or output.finished) and choice.index not in collector.recorded:
                collector.recorded.add(choice.index)
                self.metrics.record_finished(choice.finish_reason)

    async def _add(self, request_id: str, prompt: Any, sampling_params: SamplingParams) -> _Collector:
        async with self._lock:  # checked under the lock: the loop may die while we wait for it
            if not self.is_running:
                raise EngineDeadError(self._dead_message())
            if request_id in self._collectors:
                raise ValueError(f"request id {request_id!r} is already in use")
            self.engine.add_request(request_id, prompt, _as_delta(sampling_params))
            if self.request_logger is not None:
                self.request_logger.log(request_id, prompt, sampling_params)
            collector = _Collector(getattr(sampling_params, "n", 1) or 1)
            self._collectors[request_id] = collector
        self._wake.set()
        return collector

    def abort(self, request_id: str) -> None:
        """Abort a request soon (before the next step); never blocks, safe in `finally`."""
        collector = self._collectors.pop(request_id, None)
        if collector is not None:
            self._pending_aborts.add(request_id)
            if self.metrics is not None:
                self.metrics.aborted.inc(max(collector.num_completions - len(collector.recorded), 0))
            self._wake.set()

    async def get_stats(self) -> dict:
        async with self._lock:
            return dict(self.engine.get_stats())

    # -- the loop --------------------------------------------------------------------------
    async def _run_loop(self) -> None:
        try:
            while True:
                if self.dead_error is not None:  # a step failed and the engine is dead: no more steps
                    self._fail_all(EngineDeadError(self._dead_message()))
                    self._apply_aborts()  # every request's KV blocks are freed
                    return
                if not self._pending_aborts and not self.engine.has_unfinished_requests():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                async with self._lock:
                    self._apply_aborts()
                    outputs = await self._step() if self.engine.has_unfinished_requests() else []
                    self._update_stats()
                self._deliver(outputs)
                await asyncio.sleep(0)  # let handlers read outputs and add requests
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a bug in this loop: fail everyone, report unhealthy
            logger.exception("engine loop died")
            self.dead_error = e
            self._fail_all(EngineDeadError(f"engine loop died: {e!r}"))
            raise

    async def _step(self) -> list[StepOutput]:
        try:
            outputs = await asyncio.to_thread(self.engine.step)
        except Exception as e:
            dead = await self._health_error()
            if dead is None:
                logger.exception("engine step failed; failing the %d requests in flight", len(self._collectors))
                self._fail_all(e)
                return []
            logger.error("the engine is dead; failing the %d requests in flight: %s", len(self._collectors), e)
            self.dead_error = e  # the step's error tells the first failure (the health check's may wrap it)
            return []
        for request_id, why in self.engine.take_failed_requests().items():  # failed alone; the others go on
            self._joiner.forget(request_id)
            collector = self._collectors.pop(request_id, None)
            if collector is not None:
                collector.fail(RuntimeError(why))
        return [self._joiner.snapshot(o) for o in outputs]

    async def _health_error(self) -> Exception | None:
        """The engine's `check_health` error (a worker exited), or None while it can still run steps.
        In a thread: telling a worker's death may wait for its exit status."""
        try:
            await asyncio.to_thread(self.engine.check_health)
        except Exception as e:  # noqa: BLE001 - whatever it is, the engine cannot step any more
            return e
        return None

    def _dead_message(self) -> str:
        return "the engine loop is not running" if self.dead_error is None else f"the engine is dead: {self.dead_error}"

    async def check_health(self) -> None:
        """EngineDeadError when no request can be served: the loop stopped, or the engine is dead
        (`LLMEngine.check_health`; for tensor parallelism, a worker that exited, even while idle)."""
        if not self.is_running:
            raise EngineDeadError(self._dead_message())
        dead = await self._health_error()  # reported, not latched here: the next step finds it (a dead
        if dead is not None:                # worker marks its executor dead for good)
            raise EngineDeadError(f"the engine is dead: {dead}")

    def _apply_aborts(self) -> None:
        aborts, self._pending_aborts = self._pending_aborts, set()
        for request_id in aborts:
            self._joiner.forget(request_id)
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of request %s failed", request_id)

    def _update_stats(self) -> None:
        if self.metrics is not None:
            self.metrics.update_engine_stats(self.engine.get_stats())

    def _deliver(self, outputs: list[StepOutput]) -> None:
        for output in outputs:
            collector = self._collectors.get(output.request_id)
            if collector is None:
                self._joiner.forget(output.request_id)
                continue  # aborted meanwhile
            if output.finished:
                del self._collectors[output.request_id]
            collector.put(output)

    def _fail_all(self, error: BaseException) -> None:
        """Give `error` to every request in flight and free their blocks."""
        collectors, self._collectors = self._collectors, {}
        self._joiner.forget_all()
        for request_id, collector in collectors.items():
            collector.fail(error)
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of failed request %s failed", request_id)


class _LatencyTimer:
    """Feeds TTFT, inter-token latency, token counts and e2e latency of one request to the metrics. With n > 1 each
    choice is timed as vLLM times each of its child requests: a TTFT at its first token, an inter-token gap per later
    token (one step's time, however many choices gained a token in that step), an e2e latency when it finishes."""

    def __init__(self, metrics: ServerMetrics | None, arrival: float):
        self.metrics = metrics
        self.arrival = arrival
        self.last_time: float | None = None
        self.num_tokens = 0
        self.choice_tokens: dict[int, int] = {}
        """Each choice's token count at the last output."""
        self.ended: set[int] = set()
        """The choices whose e2e latency is recorded."""
        self.counted_prompt = False

    def observe(self, output: StepOutput) -> None:
        m = self.metrics
        if m is None:
            return
        now = time.monotonic()
        if not self.counted_prompt:
            m.prompt_tokens.inc(output.num_prompt_tokens)
            self.counted_prompt = True
        new_tokens = output.num_generated_tokens - self.num_tokens
        if new_tokens > 0:
            m.generation_tokens.inc(new_tokens)
            # a slow reader may see several steps' tokens at once: each later token is still one gap
            gap = (now - self.last_time) / self._steps(output) if self.last_time is not None else None
            for choice in output.choices:
                before, count = self.choice_tokens.get(choice.index, 0), len(choice.token_ids)
                if before == 0 and count > 0:
                    m.ttft.observe(now - self.arrival)
                for _ in range(count - max(before, 1) if gap is not None else 0):
                    m.itl.observe(gap)
            self.last_time = now
            self.num_tokens = output.num_generated_tokens
            self.choice_tokens = {c.index: len(c.token_ids) for c in output.choices}
        for choice in output.choices:
            if (choice.finish_reason is not None or output.finished) and choice.index not in self.ended:
                self.ended.add(choice.index)
                m.e2e.observe(now - self.arrival)

    def _steps(self, output: StepOutput) -> int:
        """The steps since the last output: the most tokens one choice gained (at least 1)."""
        return max([len(c.token_ids) - self.choice_tokens.get(c.index, 0) for c in output.choices] + [1])


def _as_delta(params):
    """The request's SamplingParams asking the engine for deltas (a copy; FINAL_ONLY and pooling ones unchanged)."""
    if isinstance(params, SamplingParams) and params.output_kind == RequestOutputKind.CUMULATIVE:
        params = copy.copy(params)
        params.output_kind = RequestOutputKind.DELTA
    return params
