"""Where a symbolic trace stopped in a model's code, and why, in words a reader of `fxrewrite explain` can act on."""

from __future__ import annotations

import importlib.util
import inspect
import os
import traceback

import torch

# Errors a symbolic trace raises inside the model's code, said as what the code does.
_TRACE_ERRORS_IN_WORDS = {
    "object does not support item assignment":
        "the forward assigns into a tensor by index (`x[...] = ...`), which a symbolic trace does not follow",
}


def error_location(exc: BaseException, cls: type) -> str:
    """'file:line: Error: message' at the last frame in the forward's file (else the last frame outside torch and
    fxrewrite: a decorated forward), the message in words where it is a known limit of tracing."""
    try:
        filename = inspect.getsourcefile(inspect.unwrap(cls.forward))
    except TypeError:
        filename = None
    stack = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in stack if f.filename == filename] or [f for f in stack if not _internal(f.filename)]
    where = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
    message = next((words for key, words in _TRACE_ERRORS_IN_WORDS.items() if key in str(exc)), None)
    return f"{where}{message}" if message else f"{where}{type(exc).__name__}: {exc}"


def _internal(filename: str) -> bool:
    """A frame of torch's or of this project's code (fxrewrite/ and the folders mapped into it: kernels/, ...)."""
    roots = [os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__))]
    for sub in ("kernels", "patterns", "runtime"):
        spec = importlib.util.find_spec(f"fxrewrite.{sub}")
        roots += list(spec.submodule_search_locations or ()) if spec else []
    return filename.startswith("<") or any(filename.startswith(root + os.sep) for root in roots)
