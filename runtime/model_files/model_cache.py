"""The on-disk cache of model folders built locally (GGUF conversions, tokenizers, demo models).

Layout: `cache_root()/models/<name>-<key>/`, a complete Hugging Face folder plus
`fxrewrite_build.json` (what it was built from, and when). A folder is built in a temporary sibling
and renamed into place, so another process never sees half a folder; an exclusive file lock on
`<folder>.lock` keeps two processes from spending the same build twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

try:  # POSIX only; elsewhere concurrent builders just race and the loser's rename is dropped
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

BUILD_INFO = "fxrewrite_build.json"


def cache_root() -> Path:
    """Root of fxrewrite's cache: `$FXREWRITE_CACHE`, else `$XDG_CACHE_HOME/fxrewrite`,
    else `~/.cache/fxrewrite`. Read on every call, so tests can point it at a temporary folder."""
    env = os.environ.get("FXREWRITE_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "fxrewrite"


_SAMPLE_BYTES = 1 << 20  # the head (GGUF: its metadata, the tokenizer included) and tail read in full
_SAMPLES = 32  # evenly spaced blocks of the middle (the tensor data: a fine-tune changes every tensor)
_BLOCK_BYTES = 1 << 16


def file_key(path: str | os.PathLike, *extra: object) -> str:
    """A short hex key for a source file's content, plus any `extra` values: its size, its first and last
    MiB and 32 evenly spaced 64 KiB blocks of the rest (about 4 MiB read; hashing all of a 100 MB GGUF
    would cost a second per start). Not its path nor its mtime: the same file installed in another
    virtual environment maps to the same cached build instead of a new conversion."""
    p = Path(path).resolve()
    size = p.stat().st_size
    digest = hashlib.sha256(f"{size}|{'|'.join(map(str, extra))}|".encode())
    with open(p, "rb") as fh:
        digest.update(fh.read(_SAMPLE_BYTES))
        middle = max(size - 2 * _SAMPLE_BYTES, 0)
        for i in range(_SAMPLES if middle > 0 else 0):
            fh.seek(_SAMPLE_BYTES + middle * i // _SAMPLES)
            digest.update(fh.read(_BLOCK_BYTES))
        fh.seek(max(size - _SAMPLE_BYTES, 0))
        digest.update(fh.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:12]


def read_build_info(folder: str | os.PathLike) -> dict:
    """The `fxrewrite_build.json` record of a cached folder ({} when absent)."""
    f = Path(folder) / BUILD_INFO
    return json.loads(f.read_text()) if f.is_file() else {}


@contextmanager
def _locked(lock_path: Path):
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as fh:
        if fcntl is not None:
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(fh, fcntl.LOCK_UN)


def full_hash(path: str | os.PathLike) -> str:
    """sha256 hex digest of the whole file (about 0.3 s for a 100 MB GGUF file)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 23), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _source_record(source: Path) -> dict:
    st = source.stat()
    return {"source": str(source), "source_size": st.st_size, "source_sha256": full_hash(source),
            "verified": [[str(source), st.st_size, st.st_mtime_ns]]}


def _stale(final: Path, source: Path | None) -> bool:
    """Whether `source` holds other bytes than the file `final` was built from (`file_key` samples the content, so
    an edit between the samples keeps the key): decided by the full hash, once per (path, size, mtime) of a source;
    the record keeps those it found equal ("verified"), so an unchanged file (or the same file in another virtual
    environment) is hashed once, not at every start."""
    if source is None:
        return False
    record = read_build_info(final)
    if "source_sha256" not in record:
        return False  # built before sources were recorded
    st = source.stat()
    seen = [str(source), st.st_size, st.st_mtime_ns]
    if seen in record.get("verified", []):
        return False
    if full_hash(source) != record["source_sha256"]:
        return True
    record["verified"] = [*record.get("verified", []), seen]
    fd, tmp = tempfile.mkstemp(prefix=f".{BUILD_INFO}.", dir=final)  # one per writer (threads, processes)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(record, indent=2, default=str) + "\n")
    os.replace(tmp, final / BUILD_INFO)  # whole: a reader never sees half a record
    return False


def cached_build(name: str, key: str, build: Callable[[Path], None], *, info: dict | None = None,
                 root: str | os.PathLike | None = None, source: str | os.PathLike | None = None) -> Path:
    """Return `<root>/models/<name>-<key>`, calling `build(tmp_dir)` to fill it on first use.

    `build` writes the complete folder into the empty `tmp_dir` it is given; the folder is then
    renamed into place with a `fxrewrite_build.json` holding `info` and the build time (seconds).
    Later calls (any process) return the existing folder without calling `build`, unless `source` (the file
    the folder is built from; its full hash is recorded) now holds other bytes: then the folder is built again
    (`_stale`). Errors from `build` propagate and leave nothing behind.
    """
    models = Path(root) if root is not None else cache_root() / "models"
    final = models / f"{name}-{key}"
    source = Path(source).resolve() if source is not None else None
    if (final / BUILD_INFO).is_file() and not _stale(final, source):
        return final
    with _locked(models / f".{name}-{key}.lock"):
        if (final / BUILD_INFO).is_file() and not _stale(final, source):  # another process finished it meanwhile
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=models))
        try:
            start = time.perf_counter()
            build(tmp)
            record = {**(info or {}), **(_source_record(source) if source is not None else {}),
                      "built_at": time.time(), "build_seconds": round(time.perf_counter() - start, 2)}
            (tmp / BUILD_INFO).write_text(json.dumps(record, indent=2, default=str) + "\n")
            if final.exists():  # an incomplete folder (no build record) or one of a changed source: replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final
