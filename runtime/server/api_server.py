"""The OpenAI-compatible HTTP server: FastAPI app over an `AsyncLLMEngine`, run by uvicorn.

Endpoints: GET /v1/models (and /v1/models/{id}), POST /v1/completions, POST /v1/chat/completions (SSE when
`stream` is true, ending with `data: [DONE]`), POST /v1/responses (OpenAI's Responses API, served on the chat
path: `instructions` and the input items become chat messages, the reply becomes output items, and with `stream`
OpenAI's typed events; `serving_responses`, `responses_stream`; nothing is stored, as in vLLM without its response
store), POST /v1/embeddings, and vLLM's POST /score (also /v1/score) and POST /rerank (also /v1/rerank, /v2/rerank),
scores by the cosine similarity of embeddings (`serving_score`) (these four: runner "pooling" only; the others
then answer 400), POST /tokenize, POST /detokenize (vLLM's paths; also under /v1), GET /health (and vLLM's GET /
POST /ping, the same), GET /metrics (Prometheus), GET /version.
With an API key, every /v1 and /v2 route, /score, /rerank, /tokenize and /detokenize need `Authorization: Bearer
<key>` (compared in constant time); /health, /ping, /metrics and /version stay open, as in vLLM.
"""

from __future__ import annotations

import hmac
import logging
import signal
import socket
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from fxrewrite import __version__
from fxrewrite.runtime.gc_passes import fewer_gc_passes, frozen_startup_heap
from fxrewrite.runtime.server.async_engine import AsyncLLMEngine
from fxrewrite.runtime.server.async_tokenizer import AsyncTokenizer
from fxrewrite.runtime.server.errors import OpenAIError, error_response, install_error_handlers
from fxrewrite.runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from fxrewrite.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from fxrewrite.runtime.server.protocol_responses import ModelCard, ModelList
from fxrewrite.runtime.server.serving_chat import OpenAIServingChat
from fxrewrite.runtime.server.responses_protocol import ResponsesRequest
from fxrewrite.runtime.server.serving_completion import OpenAIServingCompletion
from fxrewrite.runtime.server.serving_responses import OpenAIServingResponses, not_stored
from fxrewrite.runtime.server.serving_embedding import EmbeddingRequest, OpenAIServingEmbedding
from fxrewrite.runtime.server.serving_score import OpenAIServingScores, add_score_routes
from fxrewrite.runtime.server.server_options import RequestIdHeaderMiddleware, ServerOptions
from fxrewrite.runtime.server.shutdown import GRACEFUL_SHUTDOWN_S, CutStreamsLog, ShutdownAnswers
from fxrewrite.runtime.server.serving_tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from fxrewrite.runtime.server.reasoning import ReasoningParser
from fxrewrite.runtime.server.tool_parsers import ToolParser

if TYPE_CHECKING:
    from fxrewrite.runtime.engine.llm_engine import LLMEngine

"""Seconds `fxrewrite serve` lets open streams run on after Ctrl-C / SIGTERM before it ends them."""
logger = logging.getLogger(__name__)


class RequestLogger:
    """Logs each admitted request (vLLM's --enable-log-requests): id, prompt text and token ids (each cut
    to max_log_len characters / ids; None: whole; the text is that of the logged ids) and sampling params, at INFO on
    `fxrewrite.requests` (printed to stderr when logging is not configured otherwise)."""

    def __init__(self, max_log_len: int | None, tokenizer: Any = None):
        self.max_log_len = max_log_len
        self.tokenizer = tokenizer
        self.logger = logging.getLogger("fxrewrite.requests")
        self.logger.setLevel(logging.INFO)
        if not self.logger.handlers and not logging.getLogger().handlers:
            self.logger.addHandler(logging.StreamHandler())

    def log(self, request_id: str, prompt: Any, params: Any) -> None:
        cut = slice(None, self.max_log_len)
        ids = None
        if not isinstance(prompt, str):
            ids = list(prompt)[cut]
            # only the logged ids are decoded (this runs on the event loop; a prompt may be millions of tokens)
            prompt = self.tokenizer.decode(ids) if self.tokenizer is not None else None
        text = prompt[cut] if prompt is not None else None
        self.logger.info("Received request %s: prompt: %r, prompt_token_ids: %s, params: %s",
                         request_id, text, ids, params)


def _needs_key(path: str) -> bool:
    """/v1 and /v2 routes, /score and /rerank (they run the model; vLLM's current middleware guards every route
    but its health, metrics and docs ones, /v2 included), and /tokenize and /detokenize: older vLLM leaves those
    open, but they render chat templates (a request's own with --trust-request-chat-template), so a key guards
    them as it guards /v1/tokenize."""
    return path.startswith(("/v1", "/v2")) or path in ("/tokenize", "/detokenize", "/score", "/rerank")


def _route_path(scope) -> str:
    """The path routes match: without the root path (--root-path) that uvicorn puts in front of it."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class APIKeyMiddleware:
    """ASGI middleware: requests to guarded paths (`_needs_key`) without `Authorization: Bearer <api_key>` get a 401.

    Plain ASGI (not BaseHTTPMiddleware) so that streaming responses and disconnects pass through.
    """

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and _needs_key(_route_path(scope)):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                message = "missing API key" if not given else "invalid API key"
                response = error_response(HTTPStatus.UNAUTHORIZED,
                                          f"{message}: send 'Authorization: Bearer <key>'",
                                          None, "invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _add_middleware(app: FastAPI, api_key: str | None, cors: dict[str, Any] | None, options: ServerOptions) -> None:
    if options.request_id_headers:  # added first, so innermost: a 401 from the key check has no id
        app.add_middleware(RequestIdHeaderMiddleware)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if cors is not None:  # added last, so outermost: a browser's preflight is answered before the key check
        app.add_middleware(CORSMiddleware, **cors)


def build_app(
    engine: LLMEngine,
    *,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    generation_defaults: dict[str, Any] | None = None,
    chat_template: str | None = None,
    tool_parser: ToolParser | None = None, reasoning_parser: ReasoningParser | None = None,
    log_requests: bool = False, max_log_len: int | None = None,
    trust_request_chat_template: bool = False,
    cors: dict[str, Any] | None = None,
    options: ServerOptions | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine`; its engine loop runs while the app's lifespan does.

    served_model_names: the names clients put in `model` (default: the model as given to the engine).
    chat_template: template text replacing the tokenizer's. tool_parser: the parser of tool_choice
    "auto" (None refuses "auto"). reasoning_parser: splits chat replies' think blocks off (--reasoning-parser).
    log_requests: log each request's prompt (its first max_log_len characters or token ids; all when None) and
    sampling parameters, as vLLM's --enable-log-requests.
    trust_request_chat_template: a chat request's own `chat_template` is used (else it is a 400), as
    vLLM's --trust-request-chat-template. cors: Starlette `CORSMiddleware` keyword arguments (allow_origins,
    allow_credentials, allow_methods, allow_headers: vLLM's --allowed-origins ... flags), or None for no CORS
    headers. options: serve's server-wide flags (`ServerOptions`). Prompts are tokenized in one thread shared by every handler
    (`AsyncTokenizer`), so the event loop (and /health) keeps answering while a long prompt is tokenized.
    """
    names, options = list(served_model_names or [str(engine.model_config.model)]), options or ServerOptions()
    metrics = ServerMetrics(names[0])
    async_engine, tokenizer = AsyncLLMEngine(engine, metrics), AsyncTokenizer(engine.tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        metrics.update_engine_stats(engine.get_stats())
        async_engine.start()
        try:
            with frozen_startup_heap(), fewer_gc_passes():  # GC passes a step, as LLM.generate; no full walks of it
                yield
        finally:
            tokenizer.shutdown()
            await async_engine.stop()

    app = FastAPI(title="fxrewrite server", version=__version__, lifespan=lifespan, **options.fastapi_kwargs())
    app.state.async_engine, app.state.metrics, app.state.served_model_names = async_engine, metrics, names
    install_error_handlers(app)
    _add_middleware(app, api_key, cors, options)
    completion = OpenAIServingCompletion(async_engine, names, generation_defaults, tokenizer)
    chat = OpenAIServingChat(async_engine, names, generation_defaults, tokenizer, chat_template=chat_template,
                             tool_parser=tool_parser, reasoning_parser=reasoning_parser,
                             trust_request_chat_template=trust_request_chat_template)
    app.state.async_tokenizer, app.state.serving_chat, app.state.serving_completion = tokenizer, chat, completion
    if log_requests:
        async_engine.request_logger = RequestLogger(max_log_len, engine.tokenizer)
    _add_routes(app, engine, names, completion, chat, metrics, options)
    _add_pooling_routes(app, OpenAIServingEmbedding(async_engine, names, generation_defaults, tokenizer, chat=chat),
                        OpenAIServingScores(async_engine, names, generation_defaults, tokenizer))
    return app


def _add_pooling_routes(app: FastAPI, embedding: OpenAIServingEmbedding, scores: OpenAIServingScores) -> None:
    """POST /v1/embeddings, and vLLM's /score and /rerank paths (`serving_score.add_score_routes`)."""

    @app.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw_request: Request):
        return JSONResponse((await embedding.create_embedding(request, raw_request)).model_dump())

    add_score_routes(app, scores)


def _check_generates(engine: LLMEngine, api: str) -> None:
    """A pooling server answers completions and chat with vLLM's 400."""
    if engine.config.is_pooling:
        raise OpenAIError(HTTPStatus.BAD_REQUEST, f"The model does not support the {api} API: this server runs "
                          "--runner pooling (embeddings: POST /v1/embeddings; scores: POST /score, /rerank)", code="model_not_supported")


def _add_responses_route(app: FastAPI, engine: LLMEngine, chat: OpenAIServingChat) -> None:
    """POST /v1/responses, served through the chat handler (`serving_responses`); vLLM's GET /v1/responses/{id} and
    POST /v1/responses/{id}/cancel answer its 404 for any id (nothing is stored)."""
    responses = OpenAIServingResponses(chat)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request):
        _check_generates(engine, "Responses")
        return await responses.create_response(request, raw_request)

    @app.get("/v1/responses/{response_id}")
    @app.post("/v1/responses/{response_id}/cancel")
    async def stored_response(response_id: str):
        raise not_stored(response_id)


def _add_routes(app: FastAPI, engine: LLMEngine, names: list[str], completion: OpenAIServingCompletion,
                chat: OpenAIServingChat, metrics: ServerMetrics, options: ServerOptions) -> None:
    model_config = engine.model_config
    root = str(getattr(model_config, "model_path", model_config.model))
    completion.prompt_tokens_details = chat.prompt_tokens_details = options.prompt_tokens_details
    chat.content_format = options.chat_template_content_format

    @app.get("/health")
    @app.get("/ping")  # vLLM's (SageMaker's health route), GET and POST
    @app.post("/ping")
    async def health():
        await app.state.async_engine.check_health()  # EngineDeadError: a 503 (e.g. a dead tensor-parallel worker)
        return Response(status_code=200)

    @app.get("/version")
    async def show_version():
        return {"version": __version__}

    @app.get("/metrics")
    async def show_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, root=root, max_model_len=model_config.max_model_len)

    @app.get("/v1/models")
    async def show_models():
        return JSONResponse(ModelList(data=[card(name) for name in names]).model_dump())

    @app.get("/v1/models/{model_id:path}")  # OpenAI's retrieve-model; :path, as served names hold "/"
    async def show_model(model_id: str):
        if model_id not in names:
            raise OpenAIError(HTTPStatus.NOT_FOUND, f"The model `{model_id}` does not exist; this server serves "
                              f"{', '.join(map(repr, names))}", param="model", code="model_not_found")
        return JSONResponse(card(model_id).model_dump())

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request):
        _check_generates(engine, "Completions")
        options.apply(request)
        return await completion.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        _check_generates(engine, "Chat Completions")
        options.apply(request)
        return await chat.create_chat_completion(request, raw_request)

    _add_responses_route(app, engine, chat)

    # vLLM's paths are /tokenize and /detokenize; the /v1 ones are kept for this server's earlier clients.
    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def create_tokenize(request: TokenizeRequest):
        return JSONResponse((await tokenize(chat, request)).model_dump())

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def create_detokenize(request: DetokenizeRequest):
        return JSONResponse((await detokenize(chat, request)).model_dump())


def run_server(app: FastAPI, sock: socket.socket, log_level: str = "info", **uvicorn_kwargs: Any) -> None:
    """Serve `app` with uvicorn on `sock` (bound, not yet listening) until interrupted (blocks). SIGTERM ends it as Ctrl-C does: uvicorn shuts down
    gracefully and then re-raises the signal it caught, which by default would kill the process before the engine's
    exit handlers free its workers' shared memory (the resource tracker then warned of leaked segments, TP > 1);
    here the re-raised SIGTERM becomes a normal exit (status 0). uvicorn_kwargs: more uvicorn.Config arguments
    (serve's root_path, access_log)."""
    import uvicorn

    previous = signal.signal(signal.SIGTERM, _exit_normally)
    cut_streams = CutStreamsLog()
    logging.getLogger("uvicorn.error").addFilter(cut_streams)
    try:
        # timeout_graceful_shutdown: Ctrl-C / SIGTERM with streams open ends them after a few seconds (uvicorn
        # otherwise waits for every stream to finish, without a bound).
        host, port = sock.getsockname()[:2]
        config = uvicorn.Config(ShutdownAnswers(app), host=host, port=port, log_level=log_level, timeout_keep_alive=5,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, **uvicorn_kwargs)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        logging.getLogger("uvicorn.error").removeFilter(cut_streams)


def _exit_normally(signum, frame) -> None:
    raise SystemExit(0)
