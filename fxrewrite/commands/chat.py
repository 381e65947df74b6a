"""`fxrewrite chat [MODEL]`: an interactive chat in the terminal; quits on EOF (Ctrl-D) or "exit"."""

from __future__ import annotations

import argparse
import sys

from fxrewrite.commands.engine_args import add_engine_arguments, add_model_argument
from fxrewrite.commands.sampling_args import add_sampling_arguments, load_llm
from fxrewrite.errors import UserInputError

QUIT_WORDS = ("exit", "quit", "/exit", "/quit")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--system-prompt", default=None, help="system message that opens the conversation")
    add_sampling_arguments(parser)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    llm, params = load_llm(args)
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    model_config = llm.llm_engine.model_config
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {model_config.model}; type 'exit' or press Ctrl-D to quit", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in QUIT_WORDS:  # "" is EOF
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        try:
            (output,) = llm.chat(messages, params, use_tqdm=False)
        except UserInputError as e:  # e.g. the conversation outgrew the context: the session goes on
            messages.pop()
            print(f"fxrewrite chat: error: {str(e).removeprefix('prompt 0: ')}; that message was not sent "
                  "(the whole conversation is the prompt: start a new chat or raise --max-model-len)",
                  file=sys.stderr, flush=True)
            continue
        reply = output.outputs[0].text
        print(reply, flush=True)
        messages.append({"role": "assistant", "content": reply})
