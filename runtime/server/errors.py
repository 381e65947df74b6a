"""Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.

Handlers registered by `install_error_handlers(app)` turn request-validation failures (FastAPI's
422, malformed JSON included) into 400s, `OpenAIError` into its status, and anything unexpected
into a 500, so that every error a client sees has the same shape and the openai client raises the
matching exception (BadRequestError, AuthenticationError, NotFoundError, InternalServerError).
"""

from __future__ import annotations

import logging
import sys
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from fxrewrite.runtime.server.protocol import ErrorInfo, ErrorResponse
from fxrewrite.runtime.server.validation_errors import describe_errors

logger = logging.getLogger(__name__)

_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    503: "server_error",
}


class OpenAIError(Exception):
    """An error to send back as `status` with an OpenAI-shaped body.

    `param` names the request field at fault (or None); `code` is a short machine-readable string.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The JSON body of an error response."""
    error_type = _TYPE_OF_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    info = ErrorInfo(message=message, type=error_type, param=param, code=code)
    return ErrorResponse(error=info).model_dump()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def _describe_validation(exc: RequestValidationError, content_type: str | None = None) -> tuple[str, str | None, str]:
    """(message, param, code) of the first validation error, e.g. ("temperature: ...", "temperature", ...);
    `content_type`: the request's header (a body that is not a JSON object names it first)."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None, "invalid_request"
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return f"request body is not valid JSON: {detail}".rstrip(": "), None, "json_invalid"
    if not [part for part in first.get("loc", ()) if part != "body"] and first.get("type") in (
            "missing", "model_attributes_type", "dict_type"):
        media = (content_type or "").split(";")[0].strip().lower()
        if media != "application/json":  # FastAPI did not parse the body: the header is what is wrong
            sent = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
            return (f"request body must be sent with Content-Type: application/json (got {sent})",
                    None, "invalid_body")
        return "request body must be a JSON object", None, "invalid_body"
    message, param = describe_errors(errors)
    return message, param, "invalid_value"


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param, code = _describe_validation(exc, request.headers.get("content-type"))
    return error_response(HTTPStatus.BAD_REQUEST, message, param, code)


async def _on_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param, exc.code)


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == HTTPStatus.BAD_REQUEST and exc.detail == _FASTAPI_BODY_ERROR:  # bytes json could not read
        if isinstance(exc.__cause__, RecursionError):  # valid JSON, but json.loads recurses once per level
            return error_response(exc.status_code, "request body is nested too deeply to parse (arrays and objects "
                                  f"within each other; at most about {sys.getrecursionlimit()} levels)", None,
                                  "json_invalid")
        return error_response(exc.status_code, "request body is not valid JSON (not UTF-8 text?)", None, "json_invalid")
    return error_response(exc.status_code, str(exc.detail), None, None)


_FASTAPI_BODY_ERROR = "There was an error parsing the body"
"""FastAPI's HTTPException detail when the body cannot be decoded at all (invalid UTF-8, or nesting too deep for
json.loads: the exception's cause says which), before any validation."""


class ClientDisconnected(Exception):
    """The client closed the connection before its (non-streamed) answer was ready; the request has
    been aborted. Not a server error: answered with nginx's 499 (nobody reads it) and not logged."""


async def _on_client_disconnected(request: Request, exc: ClientDisconnected) -> Response:
    logger.debug("client disconnected from %s %s", request.method, request.url.path)
    return Response(status_code=499)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    return error_response(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {type(exc).__name__}: {exc}",
                          None, "internal_error")


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on `app`."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(OpenAIError, _on_openai_error)
    app.add_exception_handler(ClientDisconnected, _on_client_disconnected)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
