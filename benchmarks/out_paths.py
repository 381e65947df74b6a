"""`--out` of the benchmark entry points, checked when the arguments are parsed: a run of several arms (minutes to
hours on a GPU) must not end in a traceback from `mkdir` or `write_text` and lose what it measured.

Two meanings, one per entry point, said in its --help: a results *folder* (`bench compare|kernels|train|rl`,
`count_launches`, `host_step`, `profile_decode`, ...; file names are made from the date and the workload) or one
JSON *file* (`saved_tensors`, `train_memory`, `train_ops`, `optimize_time`, `train_profile`, `train_gaps`).
Light on purpose: `fxrewrite.cli` builds its parser from these without importing the harness.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["results_folder", "result_file", "FOLDER_HELP", "FILE_HELP"]

FOLDER_HELP = "results folder, made now if missing (default benchmarks/results)"
FILE_HELP = "the JSON file to write (its folder made now if missing; not a folder)"


def _make_folder(path: Path, value: str, role: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # FileExistsError for a file in the way, PermissionError, ...
        raise argparse.ArgumentTypeError(f"{value!r}: cannot make {role} {str(path)!r} ({e.strerror or e})") from None


def results_folder(value: str) -> Path:
    """argparse ``type`` for a results folder: made now (parents too), so a path taken by a file or not writable
    is refused before any arm runs (argparse's usage error, exit status 2)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty path; expected a results folder")
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r} is a file; expected a results folder (file names are made "
                                         "from the date and the workload)")
    _make_folder(path, value, "the results folder")
    return path


def result_file(value: str) -> Path:
    """argparse ``type`` for one JSON result file: refused when it names a folder; its parent folder is made now."""
    path = Path(value)
    if path.is_dir() or not value.strip() or value.endswith(("/", "\\")):
        raise argparse.ArgumentTypeError(f"{value!r} is a folder; expected the path of the JSON file to write")
    _make_folder(path.parent, value, "the folder")
    return path
