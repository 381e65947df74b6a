"""`fxrewrite` command line: `serve`, `generate`, `chat`, `explain`, `bench`.

Each subcommand lives in `fxrewrite/commands/<name>.py` with `add_arguments(parser)` and
`run(args) -> int`; those modules import the heavy parts (torch, the engine) inside `run` only, so
`fxrewrite --help` stays fast. A `fxrewrite.errors.UserInputError` (a bad flag value, config,
prompt or model path) is printed as one line with exit status 2; every other exception keeps its
traceback, so an internal bug never passes for bad input. Flag names are vLLM's, so a vLLM user
changes only the command name.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys

from fxrewrite.commands.engine_args import resolve_model
from fxrewrite.errors import UserInputError

# (name, module, one-line help); the order is the order of `fxrewrite --help`.
COMMANDS = (
    ("serve", "fxrewrite.commands.serve", "OpenAI-compatible HTTP server"),
    ("generate", "fxrewrite.commands.generate", "complete one prompt and print the text"),
    ("chat", "fxrewrite.commands.chat", "interactive chat in the terminal"),
    ("explain", "fxrewrite.commands.explain", "show what the rewrite fuses in a model, and why not"),
    ("bench", "fxrewrite.commands.bench", "before/after/native benchmarks and kernel timings"),
)


class _Parser(argparse.ArgumentParser):
    """No abbreviated flags, at every level (subparsers take their parent's class): argparse would read `--model X` as
    `--model-impl X` and name the wrong flag in its error."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fxrewrite", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name, help_text in COMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue  # a subcommand not built yet is simply not offered
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run, _parser=p)
    return parser


def _version() -> str:
    """The installed distribution's version (pyproject.toml's, through the package metadata)."""
    try:
        return importlib.metadata.version("fxrewrite")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's (argparse's parse_args reports at the top)
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    resolve_model(args, getattr(args, "_parser", parser))
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader closed stdout (`| head`): stop quietly, as Python's docs advise
        _silence_stdout()
        return 1
    except UserInputError as e:
        # Bad input from the user: one clear line. Any other error is a bug and keeps its traceback.
        print(f"fxrewrite {args.command}: error: {e}", file=sys.stderr)
        return 2


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush does not raise BrokenPipeError again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor (captured)
        pass


if __name__ == "__main__":
    raise SystemExit(main())
