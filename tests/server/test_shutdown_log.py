"""A request cut at the graceful-shutdown timeout: logged as one warning, not uvicorn's CancelledError traceback (seen
with `fxrewrite serve` stopped by SIGTERM while a client streamed; other errors keep their traceback), and answered with
a 503 error JSON, or for a stream a last error event and [DONE] (it got a plain-text 500 / a stream cut mid-event)."""

import asyncio
import json
import logging
import sys

from fxrewrite.runtime.server.shutdown import CutStreamsLog


def _record(error: BaseException) -> logging.LogRecord:
    try:
        raise error
    except BaseException:  # noqa: BLE001
        info = sys.exc_info()
    return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, "Exception in ASGI application", None, info)


def test_cancelled_stream_becomes_one_warning_line():
    record = _record(asyncio.CancelledError("Task cancelled, timeout graceful shutdown exceeded"))
    assert CutStreamsLog().filter(record)
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert logging.Formatter().format(record) == ("an open request was cut by the shutdown (requests get 5 s after "
                                                  "the first signal, none after a second; it was answered 503 and "
                                                  "aborted)")


def test_uvicorns_cancel_notice_is_a_warning():
    record = logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1,
                               "Cancel %s running task(s), timeout graceful shutdown exceeded", (1,), None)
    assert CutStreamsLog().filter(record) and record.levelname == "WARNING"


def test_a_lifespan_shutdown_cut_by_a_second_signal_is_a_warning():
    text = ('Traceback (most recent call last):\n  File "starlette/routing.py", line 668, in lifespan\n'
            "    await receive()\nasyncio.exceptions.CancelledError\n")
    record = logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, text, None, None)
    assert CutStreamsLog().filter(record) and record.levelname == "WARNING"
    assert logging.Formatter().format(record).startswith("the application's shutdown was cut by a second signal")


def test_other_errors_keep_their_traceback():
    record = _record(RuntimeError("boom"))
    assert CutStreamsLog().filter(record)
    assert record.levelno == logging.ERROR and "Traceback" in logging.Formatter().format(record)


def _cut(app) -> list[dict]:
    """The messages `ShutdownAnswers(app)` sends when its task is cancelled mid-request (as uvicorn does at the
    graceful-shutdown timeout)."""
    from fxrewrite.runtime.server.shutdown import ShutdownAnswers

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def main():
        task = asyncio.ensure_future(ShutdownAnswers(app)({"type": "http"}, None, send))
        await asyncio.sleep(0.05)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return
        raise AssertionError("the cancellation must go on")

    asyncio.run(main())
    return sent


def test_a_cut_request_gets_a_503_error_json():
    async def app(scope, receive, send):
        await asyncio.sleep(100)  # a non-streamed completion still generating

    start, body = _cut(app)
    assert start["status"] == 503 and dict(start["headers"])[b"content-type"] == b"application/json"
    error = json.loads(body["body"])["error"]
    assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]


def test_a_cut_stream_ends_with_an_error_event_and_done():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await asyncio.sleep(100)

    last = _cut(app)[-1]
    assert not last.get("more_body", False)
    events = last["body"].decode().split("\n\n")
    assert json.loads(events[0].removeprefix("data: "))["error"]["code"] == "server_shutting_down"
    assert events[1] == "data: [DONE]"
