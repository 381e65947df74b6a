"""What a request still running at the server's shutdown gets: uvicorn cancels it `GRACEFUL_SHUTDOWN_S` after the
first Ctrl-C / SIGTERM (at once after a second), and would answer a plain-text "Internal Server Error" or end a stream
mid-event. `ShutdownAnswers` wraps the app so that such a request gets a 503 OpenAI error body, or, when it is a stream
already under way, a last error event and ``data: [DONE]``; `CutStreamsLog` turns uvicorn's report of each cut task
(a CancelledError traceback) into one warning line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from fxrewrite.runtime.server.errors import error_body
from fxrewrite.runtime.server.streaming import sse

GRACEFUL_SHUTDOWN_S = 5
"""Seconds uvicorn lets open requests run after the first Ctrl-C / SIGTERM."""

SHUTDOWN_MESSAGE = "the server is shutting down: this request was cut before it finished"


class ShutdownAnswers:
    """ASGI wrapper: a request cancelled before its response is complete gets a 503 error JSON (nothing sent yet) or a
    closing error event (a server-sent-events stream), then the cancellation goes on."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "done": False, "stream": False}

        async def tracking_send(message) -> None:
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or ())
                state["started"] = True
                state["stream"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if not state["done"]:
                with contextlib.suppress(Exception):  # the client may be gone already
                    await _answer(send, state)
            raise


async def _answer(send, state: dict) -> None:
    body = error_body(503, SHUTDOWN_MESSAGE, None, "server_shutting_down")
    if not state["started"]:
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})
    elif state["stream"]:
        await send({"type": "http.response.body", "body": (sse(json.dumps(body)) + sse("[DONE]")).encode()})


class CutStreamsLog(logging.Filter):
    """uvicorn reports each request it cancels at the graceful-shutdown timeout as "Exception in ASGI application"
    with the CancelledError's 50-line traceback, after an ERROR "Cancel N running task(s)": one warning line each
    says what happened (a shutdown the user asked for); so does starlette's traceback of a lifespan shutdown cut by a
    second signal."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and "timeout graceful shutdown exceeded" in record.getMessage():
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        text = record.getMessage() if record.levelno == logging.ERROR else ""
        if text.startswith("Traceback") and text.rstrip().splitlines()[-1].startswith("asyncio.exceptions.Cancelled"):
            # starlette's lifespan reports its shutdown cut by a second Ctrl-C as a formatted traceback
            record.msg, record.args = ("the application's shutdown was cut by a second signal (the engine's exit "
                                       "handlers still stop its workers)"), None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, asyncio.CancelledError):
            record.msg, record.args, record.exc_info, record.exc_text = (
                f"an open request was cut by the shutdown (requests get {GRACEFUL_SHUTDOWN_S} s after the first "
                "signal, none after a second; it was answered 503 and aborted)"), None, None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True
