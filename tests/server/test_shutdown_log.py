"""A stream cut at the graceful-shutdown timeout is logged as one warning, not uvicorn's CancelledError traceback
(seen with `fxrewrite serve` stopped by SIGTERM while a client streamed); other errors keep their traceback."""

import asyncio
import logging
import sys

from fxrewrite.runtime.server.api_server import _CutStreamsAtShutdown


def _record(error: BaseException) -> logging.LogRecord:
    try:
        raise error
    except BaseException:  # noqa: BLE001
        info = sys.exc_info()
    return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, "Exception in ASGI application", None, info)


def test_cancelled_stream_becomes_one_warning_line():
    record = _record(asyncio.CancelledError("Task cancelled, timeout graceful shutdown exceeded"))
    assert _CutStreamsAtShutdown().filter(record)
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert logging.Formatter().format(record) == ("an open stream was cut by the shutdown (streams get 5 s after the "
                                                  "first signal, none after a second; its request is aborted)")


def test_uvicorns_cancel_notice_is_a_warning():
    record = logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1,
                               "Cancel %s running task(s), timeout graceful shutdown exceeded", (1,), None)
    assert _CutStreamsAtShutdown().filter(record) and record.levelname == "WARNING"


def test_other_errors_keep_their_traceback():
    record = _record(RuntimeError("boom"))
    assert _CutStreamsAtShutdown().filter(record)
    assert record.levelno == logging.ERROR and "Traceback" in logging.Formatter().format(record)
