"""`fxrewrite serve [MODEL]`: the OpenAI-compatible HTTP server (vLLM's `vllm serve` flags)."""

from __future__ import annotations

import argparse

from fxrewrite.commands.engine_args import add_engine_arguments, engine_kwargs
from fxrewrite.errors import UserInputError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="model folder, hub id or .gguf file (default: the built-in default model)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer <key>' on /v1 routes")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="name(s) clients use in 'model' (default: MODEL as given, or the default model's hub id)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug", "trace"))
    add_engine_arguments(parser)


def build_server_app(args: argparse.Namespace):
    """(engine, FastAPI app) for parsed `serve` arguments; the app's lifespan runs the engine loop."""
    from fxrewrite.runtime.model_files.default_model import DEFAULT_MODEL
    from fxrewrite.runtime.engine.llm_engine import LLMEngine
    from fxrewrite.runtime.server.api_server import build_app
    from fxrewrite.runtime.server.generation_defaults import load_generation_defaults

    engine = LLMEngine.from_kwargs(**engine_kwargs(args))
    defaults = load_generation_defaults(engine.model_config.model_path, args.generation_config)
    names = args.served_model_name or [args.model or DEFAULT_MODEL]
    app = build_app(engine, served_model_names=names, api_key=args.api_key, generation_defaults=defaults)
    return engine, app


def run(args: argparse.Namespace) -> int:
    from fxrewrite.runtime.server.api_server import run_server

    if not 0 < args.port < 65536:
        raise UserInputError(f"--port {args.port} is not a TCP port (1..65535)")
    engine, app = build_server_app(args)
    name = app.state.served_model_names[0]
    print(f"fxrewrite serve: {name} ({engine.model_config.model_path}) on http://{args.host}:{args.port}/v1",
          flush=True)
    run_server(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0
