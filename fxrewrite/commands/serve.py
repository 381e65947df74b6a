"""`fxrewrite serve [MODEL]`: the OpenAI-compatible HTTP server (vLLM's `vllm serve` flags)."""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import ssl

from fxrewrite.commands.engine_args import add_engine_arguments, add_model_argument, engine_kwargs
from fxrewrite.commands.sampling_args import load_chat_template
from fxrewrite.errors import UserInputError
from fxrewrite.runtime.llm_compat import CHAT_TEMPLATE_CONTENT_FORMATS, check_content_format
from fxrewrite.runtime.server.reasoning import REASONING_PARSERS, get_reasoning_parser
from fxrewrite.runtime.server.tool_parsers import TOOL_PARSERS, get_tool_parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer <key>' on /v1 routes, /tokenize and /detokenize "
                             "(default: $VLLM_API_KEY when set, as vLLM)")
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "headers")):
        parser.add_argument(flag, type=_json_strings(flag), default=["*"],
                            help=f'CORS: allowed {what}, a JSON list (default ["*"], as vLLM)')
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="name(s) clients use in 'model' (default: MODEL as given, or the default model's hub id)")
    parser.add_argument("--chat-template", default=None,
                        help="chat template replacing the tokenizer's: a file path, or the template text itself")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="use a chat request's own chat_template (the template text); without it such a "
                             "request is refused with a 400 (a template is code the server runs)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='allow tool_choice "auto": the model\'s tool calls are parsed from its text')
    parser.add_argument("--tool-call-parser", default="auto", choices=("auto", *sorted(TOOL_PARSERS)),
                        help="format of the model's tool calls (auto: chosen by the chat template)")
    parser.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                        help="split a chat reply's <think>...</think> block into the message's 'reasoning' "
                             "(and 'reasoning_content') field, the rest staying 'content' (default: no split)")
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="log every request's prompt and sampling parameters")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="vLLM's older flag (deprecated there): requests are not logged without --enable-log-requests")
    parser.add_argument("--max-log-len", type=int, default=None,
                        help="characters (or token ids) of a prompt to log with --enable-log-requests (default: all)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug", "trace"))
    _add_server_flags(parser)
    add_engine_arguments(parser)


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's server-wide flags (`ServerOptions`)."""
    flag = parser.add_argument
    flag("--disable-uvicorn-access-log", action="store_true", help="no uvicorn access log line per request")
    flag("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    flag("--root-path", default="", help="path prefix a proxy in front strips (uvicorn's root_path)")
    flag("--enable-request-id-headers", action="store_true",
         help="every response carries X-Request-Id: the request's own header, or a new id")
    flag("--response-role", default="assistant",
         help="a chat reply's role when add_generation_prompt is true (default 'assistant')")
    flag("--return-tokens-as-token-ids", action="store_true",
         help="logprobs name tokens 'token_id:<id>' for requests that do not set return_tokens_as_token_ids")
    flag("--enable-force-include-usage", action="store_true",
         help="every streamed response ends with a usage chunk, as with stream_options.include_usage")
    flag("--ssl-keyfile", default=None, help="the TLS private key file (PEM): serve HTTPS (uvicorn's ssl_keyfile)")
    flag("--ssl-certfile", default=None, help="the TLS certificate chain file (PEM): serve HTTPS")
    flag("--ssl-ca-certs", default=None, help="CA certificates (PEM) to verify client certificates with")
    flag("--ssl-cert-reqs", type=int, default=0, help="whether client certificates are required (Python's "
         "ssl.CERT_NONE 0, CERT_OPTIONAL 1, CERT_REQUIRED 2)")
    flag("--chat-template-content-format", choices=CHAT_TEMPLATE_CONTENT_FORMATS, default="auto",
         help="message content as the chat template gets it: 'string' (text parts joined; what 'auto' does here) "
              "or 'openai' (the list of {'type': 'text', 'text': ...} parts)")
    flag("--enable-prompt-tokens-details", action="store_true",
         help="usage carries prompt_tokens_details.cached_tokens (prompt tokens the prefix cache served)")


def server_options(args: argparse.Namespace):
    """`ServerOptions` of the parsed flags; UserInputError for an empty --response-role or a --root-path that
    does not start with "/"."""
    from fxrewrite.runtime.server.server_options import ServerOptions

    if not args.response_role.strip():
        raise UserInputError(f"--response-role {args.response_role!r} is empty: give a role, e.g. 'assistant'")
    if args.root_path and not args.root_path.startswith("/"):
        raise UserInputError(f"--root-path {args.root_path!r} must start with '/', e.g. '/api'")
    return ServerOptions(response_role=args.response_role, return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                         force_include_usage=args.enable_force_include_usage,
                         request_id_headers=args.enable_request_id_headers, disable_docs=args.disable_fastapi_docs,
                         prompt_tokens_details=args.enable_prompt_tokens_details,
                         chat_template_content_format=check_content_format(args.chat_template_content_format))


def uvicorn_kwargs(args: argparse.Namespace) -> dict:
    """uvicorn.Config arguments of the parsed flags (`run_server`'s uvicorn_kwargs): the TLS files are checked here
    (UserInputError naming the flag for a key or certificate that does not load), so that `run` refuses them
    before the model loads, not when uvicorn starts after it."""
    kwargs = {"root_path": args.root_path.rstrip("/"), "access_log": not args.disable_uvicorn_access_log}
    if args.ssl_keyfile or args.ssl_certfile or args.ssl_ca_certs:
        if not args.ssl_certfile:
            raise UserInputError("--ssl-keyfile / --ssl-ca-certs need --ssl-certfile (the certificate to serve)")
        if args.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise UserInputError(f"--ssl-cert-reqs {args.ssl_cert_reqs}: expected 0 (none), 1 (optional) or 2 "
                                 "(required)")
        try:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
            if args.ssl_ca_certs:
                context.load_verify_locations(args.ssl_ca_certs)
        except (OSError, ssl.SSLError) as e:  # FileNotFoundError is an OSError; a bad PEM an SSLError
            raise UserInputError(f"--ssl-certfile {args.ssl_certfile!r} / --ssl-keyfile {args.ssl_keyfile!r} / "
                                 f"--ssl-ca-certs {args.ssl_ca_certs!r} do not load: {e}") from None
        kwargs.update(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                      ssl_cert_reqs=args.ssl_cert_reqs)
    return kwargs


def _json_strings(flag: str):
    """argparse type: a JSON list of strings, else an error naming `flag` and the value."""
    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected a JSON list of strings, e.g. "
                                             '\'["https://example.com"]\'')
        return value
    return parse


def api_key(args: argparse.Namespace) -> str | None:
    """The key clients must send: ``--api-key``, else the environment's ``VLLM_API_KEY`` (vLLM's fallback, so a
    deployment that sets the key there is not left open), else None (no key). UserInputError for an empty
    ``--api-key`` (``--api-key "$KEY"`` with KEY unset would otherwise serve with no key at all)."""
    if args.api_key is not None and not args.api_key.strip():
        raise UserInputError(f"--api-key {args.api_key!r} is empty: give the key, or leave the flag out to serve "
                             "without one")
    return args.api_key or os.environ.get("VLLM_API_KEY") or None


def _served_model_names(args: argparse.Namespace, default: str) -> list[str]:
    """``--served-model-name`` (each non-empty: a request's ``model`` must name one), else MODEL or `default`."""
    empty = [n for n in args.served_model_name or () if not n.strip()]
    if empty:
        raise UserInputError(f"--served-model-name {empty[0]!r} is empty: a name clients can send is needed")
    twice = sorted({n for n in args.served_model_name or () if args.served_model_name.count(n) > 1})
    if twice:
        raise UserInputError(f"--served-model-name names {twice[0]!r} twice: give each name once")
    return args.served_model_name or [args.model or default]


def build_server_app(args: argparse.Namespace):
    """(engine, FastAPI app) for parsed `serve` arguments; the app's lifespan runs the engine loop."""
    from fxrewrite.runtime.model_files.default_model import DEFAULT_MODEL
    from fxrewrite.runtime.engine.data_parallel import make_engine
    from fxrewrite.runtime.engine_config import EngineConfig
    from fxrewrite.runtime.server.api_server import build_app
    from fxrewrite.runtime.server.generation_defaults import check_generation_config, load_generation_defaults

    if args.max_log_len is not None and args.max_log_len < 0:
        raise UserInputError(f"--max-log-len {args.max_log_len} must be at least 0")
    if args.enable_log_requests and args.disable_log_requests:
        raise UserInputError("--enable-log-requests and --disable-log-requests contradict each other: give one")
    key, names = api_key(args), _served_model_names(args, DEFAULT_MODEL)  # checked before the model loads
    options = server_options(args)
    check_generation_config(args.generation_config)
    chat_template = load_chat_template(args.chat_template)
    engine = make_engine(EngineConfig.from_kwargs(**engine_kwargs(args)))  # DPLLMEngine with -dp > 1
    defaults = load_generation_defaults(engine.model_config.model_path, args.generation_config)
    tool_parser = None
    if args.enable_auto_tool_choice:
        tool_parser = get_tool_parser(args.tool_call_parser,
                                      chat_template or getattr(engine.tokenizer, "chat_template", None))
    app = build_app(engine, served_model_names=names, api_key=key, generation_defaults=defaults,
                    chat_template=chat_template, tool_parser=tool_parser,
                    reasoning_parser=get_reasoning_parser(args.reasoning_parser),
                    log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
                    trust_request_chat_template=args.trust_request_chat_template,
                    cors={"allow_origins": args.allowed_origins, "allow_credentials": args.allow_credentials,
                          "allow_methods": args.allowed_methods, "allow_headers": args.allowed_headers},
                    options=options)
    return engine, app


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound to host:port now, before the model loads (which can take minutes), as
    vLLM binds it: a busy port fails at once, and nothing else can take it meanwhile. Port 0 binds a free port the
    OS picks (``getsockname()`` names it). SO_REUSEADDR as uvicorn sets it (a port in TIME_WAIT is free).
    UserInputError naming host:port when it cannot be bound (in use, no such address)."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserInputError(f"--host {host!r}: cannot resolve it to an address to listen on ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UserInputError(f"cannot listen on {where}: the address is already in use (another server "
                                 "running?); stop it or choose another --port") from None
        raise UserInputError(f"cannot listen on {where}: {e.strerror} (check --host and --port)") from None
    return sock


def run(args: argparse.Namespace) -> int:
    from fxrewrite.runtime.server.api_server import run_server

    if not 0 <= args.port < 65536:
        raise UserInputError(f"--port {args.port} is not a TCP port (1..65535, or 0 for a free one)")
    server_kwargs = uvicorn_kwargs(args)  # a TLS file that does not load is refused before the model loads
    scheme = "https" if "ssl_certfile" in server_kwargs else "http"
    with bind_socket(args.host, args.port) as sock:
        engine, app = build_server_app(args)
        name, port = app.state.served_model_names[0], sock.getsockname()[1]
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"fxrewrite serve: {name} ({engine.model_config.model_path}) on {scheme}://{host}:{port}/v1", flush=True)
        run_server(app, sock, log_level=args.uvicorn_log_level, **server_kwargs)
    return 0
