"""Which fxrewrite code produced a benchmark result: recorded in every result's environment."""

from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path

__all__ = ["source_revision"]


def source_revision() -> dict:
    """fxrewrite's installed version and, when run from a git checkout, its commit and whether the tree had
    uncommitted changes ("dirty"); commit None outside a checkout (a copied tree, a wheel)."""
    try:
        version = metadata.version("fxrewrite")
    except metadata.PackageNotFoundError:
        version = None
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")  # an enclosing repository (a user's project around a venv) is not ours
    commit = git("rev-parse", "HEAD") if top is not None and Path(top).resolve() == root else None
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"version": version, "commit": commit, "dirty": None if status is None else bool(status)}
