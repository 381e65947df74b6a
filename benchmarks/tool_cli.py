"""What every ``python -m fxrewrite.benchmarks.<tool>`` entry point shares with the ``fxrewrite`` CLI: bad input
is one line on stderr (exit status 2), not a traceback."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from fxrewrite.errors import UserInputError

__all__ = ["count_argument", "device_argument", "json_object_argument", "require_cuda", "run_cli"]


def run_cli(main) -> int:
    """``main()`` of a ``python -m fxrewrite.benchmarks.<tool>`` entry point, as the ``fxrewrite`` CLI runs its
    commands: bad input (a UserInputError: an unknown config, a bad value) is one line on stderr and exit
    status 2; any other error is a bug and keeps its traceback."""
    try:
        return int(main() or 0)
    except UserInputError as e:
        print(f"python -m fxrewrite.benchmarks.{Path(sys.argv[0]).stem}: error: {e}", file=sys.stderr)
        return 2


def require_cuda(tool: str) -> None:
    """SystemExit with one line (``python -m fxrewrite.benchmarks.<tool> needs a CUDA GPU ...``) when torch sees no
    CUDA device: a GPU-only tool run on a CPU machine, instead of torch's "not compiled with CUDA" traceback from
    its first CUDA tensor. Call it after parsing the arguments (``--help`` works anywhere)."""
    if not torch.cuda.is_available():
        raise SystemExit(f"python -m fxrewrite.benchmarks.{tool} needs a CUDA GPU; torch {torch.__version__} sees "
                         "none on this machine")


def device_argument(device: str) -> str:
    """An argparse ``type``: ``device`` if torch can use it, else argparse's error naming it (a CUDA device on a
    machine without one)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{device!r}: torch sees no CUDA device here; use cpu")
    return device


def count_argument(value: str) -> int:
    """An argparse ``type``: an integer of at least 1 (layers, repeats, threads, a batch size)."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def json_object_argument(value: str) -> dict:
    """An argparse ``type``: a JSON object (``--hf-overrides``), else argparse's error saying what is wrong."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at column {e.colno}): {value!r}; expected an "
                                         'object such as \'{"num_hidden_layers": 4}\'') from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got a JSON {type(parsed).__name__}: {value!r}")
    return parsed
