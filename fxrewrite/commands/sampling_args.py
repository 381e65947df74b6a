"""Sampling flags of the terminal commands (`generate`, `chat`), named as the OpenAI request fields;
`load_llm(args)` builds both commands' LLM and SamplingParams from the parsed flags; `load_chat_template`
reads `--chat-template` (generate and serve)."""

from __future__ import annotations

import argparse
from typing import Any

from fxrewrite.commands.engine_args import engine_kwargs, positive_int
from fxrewrite.errors import UserInputError
from fxrewrite.runtime.engine.chat import resolve_chat_template


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=positive_int, default=None,
                   help="most tokens to generate (default: generation_config's max_new_tokens, else 256)")
    g.add_argument("--temperature", type=float, default=None, help="0 for greedy (default: model's, else 1.0)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace, defaults: dict[str, Any]):
    """`SamplingParams` from the flags; flags left unset take `defaults` (generation_config.json)."""
    from fxrewrite.runtime.engine.sampling_params import SamplingParams

    values: dict[str, Any] = {"max_tokens": 256}
    values.update(defaults)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop"):
        given = getattr(args, name)
        if given is not None:
            values[name] = given
    return SamplingParams(**values)


def load_llm(args: argparse.Namespace):
    """(LLM of the engine flags, SamplingParams of the sampling flags over the model's
    generation_config.json defaults): what `generate` and `chat` start with."""
    from fxrewrite.runtime.llm import LLM
    from fxrewrite.runtime.server.generation_defaults import check_generation_config, load_generation_defaults

    check_generation_config(args.generation_config)
    sampling_params(args, {})  # a bad sampling flag fails now, not after the model has loaded
    kwargs = engine_kwargs(args)
    if kwargs["runner"] == "pooling":  # before the model loads
        raise UserInputError("generate and chat write text; --runner pooling (--task embed) makes an embedding "
                             "model: serve it with `fxrewrite serve MODEL --runner pooling` (POST /v1/embeddings) "
                             "or call LLM(..., runner='pooling').embed(prompts)")
    llm = LLM(**kwargs)
    defaults = load_generation_defaults(llm.llm_engine.model_config.model_path, args.generation_config)
    return llm, sampling_params(args, defaults)


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself when it looks like a template; see
    `fxrewrite.runtime.engine.chat.resolve_chat_template` (checked here, so `serve` does not start and
    answer every chat request with a 400)."""
    return resolve_chat_template(value, "--chat-template")
