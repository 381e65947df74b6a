"""`fxrewrite serve`'s server-wide options (vLLM's flags of the same names): request defaults the routes apply to
each parsed request, the FastAPI app's documentation routes, and the X-Request-Id header."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from fxrewrite.runtime.server.protocol import ChatCompletionRequest, SamplingRequest, StreamOptions


@dataclass(frozen=True)
class ServerOptions:
    """response_role: a chat reply's role after a generation prompt (--response-role; vLLM's default
    "assistant"). return_tokens_as_token_ids: the default of the request field of that name, for requests that do
    not set it (--return-tokens-as-token-ids). force_include_usage: every streamed response ends with a usage
    chunk, as if stream_options.include_usage were true (--enable-force-include-usage). request_id_headers: every
    response carries X-Request-Id, the request's own header or a new id (--enable-request-id-headers).
    disable_docs: no /docs, /redoc, /openapi.json (--disable-fastapi-docs). prompt_tokens_details: a response's
    usage carries prompt_tokens_details.cached_tokens when the prefix cache served some of the prompt
    (--enable-prompt-tokens-details). chat_template_content_format: "string" (a message's text parts joined) or
    "openai" (the list of text parts), as the chat template gets message content (--chat-template-content-format;
    "auto" is "string" here). (--root-path is uvicorn's root_path, `serve.uvicorn_kwargs`.)"""

    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    force_include_usage: bool = False
    request_id_headers: bool = False
    disable_docs: bool = False
    prompt_tokens_details: bool = False
    chat_template_content_format: str = "string"

    def apply(self, request: SamplingRequest) -> None:
        """Set the server-wide defaults on a validated request (fields the request set itself stay)."""
        if "return_tokens_as_token_ids" not in request.model_fields_set:
            request.return_tokens_as_token_ids = self.return_tokens_as_token_ids
        if self.force_include_usage and request.stream:
            continuous = bool(request.stream_options and request.stream_options.continuous_usage_stats)
            request.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=continuous)
        if isinstance(request, ChatCompletionRequest):
            request._server_role = self.response_role

    def fastapi_kwargs(self) -> dict[str, Any]:
        return {"docs_url": None, "redoc_url": None, "openapi_url": None} if self.disable_docs else {}


class RequestIdHeaderMiddleware:
    """ASGI middleware: each HTTP response gets `X-Request-Id`, the request's own X-Request-Id header or a new
    hex id (vLLM's --enable-request-id-headers). Plain ASGI, so streams pass through."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id")
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
