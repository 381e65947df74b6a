"""Session-wide test setup: no network, a model cache, tiny model folders, the `gpu` marker.

Fixtures (all session-scoped; the folders are shared, so tests must not modify them: copy with
`shutil.copytree` first when a test needs to edit files):
- `tiny_model_dir(arch="qwen3", **kwargs) -> Path`: a factory; builds
  `fxrewrite.runtime.model_files.demo.build_model_dir(dir, arch, **kwargs)` once per distinct (arch, kwargs)
  per session. Qwen archs carry Qwen3's real tokenizer (vocab 151,936), the others SmolLM2's (49,152).
- `tiny_qwen3_dir`, `tiny_llama_dir`: `tiny_model_dir("qwen3")` / `tiny_model_dir("llama")`.
- `default_model_dir -> Path`: the real SmolLM2-135M-Instruct folder (`default_model_path()`),
  built from the installed GGUF on first use (30-60 s), then reused for the session.
- `fxrewrite_cache -> Path`: the cache root used by the session.

The cache is `$FXREWRITE_CACHE` when set (export it, e.g. to ~/.cache/fxrewrite, to keep the
default model and the Qwen tokenizer across runs), else a fresh temporary folder per run, like CI, shared by
the run's xdist workers.
"""

from __future__ import annotations

import os

import pytest

# Nothing in the tests may reach the network; set before anything imports huggingface_hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Triton reads TRITON_INTERPRET once, at its first import (transformers imports it too), so the
# kernel-vs-reference tests can run Triton kernels on CPU tensors only if it is set here, first.
import torch  # noqa: E402  (importing torch does not import triton)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _module_is_slow(item) -> bool:
    marks = getattr(getattr(item, "module", None), "pytestmark", [])
    return any(m.name == "slow" for m in (marks if isinstance(marks, list) else [marks]))


def pytest_collection_modifyitems(config, items):
    # `make test` runs `--dist loadfile`: xdist hands whole files to its workers in collection order, so a long
    # file collected last keeps one worker busy while the other idles. Files marked `slow` at module level go
    # first (longest-first scheduling); the order inside a file and among the rest is kept.
    items.sort(key=lambda item: not _module_is_slow(item))
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run by make gpu-check)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def fxrewrite_cache(tmp_path_factory):
    """The session's model cache root (`$FXREWRITE_CACHE`, else a fresh temporary folder)."""
    from pathlib import Path

    preset = os.environ.get("FXREWRITE_CACHE")
    if preset:
        yield Path(preset).expanduser()
        return
    # One cache for the run's pytest-xdist workers (their basetemps share a parent that is new per run): the
    # default model (30-60 s from its GGUF) and the Qwen tokenizer are built once, not once per worker; the
    # cache's own file locks keep two workers from building the same folder at once.
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "fxrewrite-cache"
    root.mkdir(exist_ok=True)
    os.environ["FXREWRITE_CACHE"] = str(root)
    try:
        yield root
    finally:
        os.environ.pop("FXREWRITE_CACHE", None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, fxrewrite_cache):
    """Factory: `tiny_model_dir(arch="qwen3", **build_model_dir_kwargs) -> Path`, built once per
    distinct arguments per session (hidden 64, 2 layers, 4 heads, 2 kv heads by default)."""
    from fxrewrite.runtime.model_files.demo import build_model_dir

    built: dict[tuple, object] = {}

    def make(arch: str = "qwen3", **kwargs):
        key = (arch, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[key] = build_model_dir(out, arch, **kwargs)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tiny_model_dir):
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def default_model_dir(fxrewrite_cache):
    """The real default model's folder (SmolLM2-135M-Instruct, bf16), built once into the cache."""
    from fxrewrite.runtime.model_files.default_model import default_model_path

    return default_model_path()


@pytest.fixture
def python_sigint():
    """Python's own Ctrl-C handler for the test (`signal.default_int_handler`), the previous one back after: a
    process started in the background by a non-interactive shell inherits SIGINT ignored, and then
    `_thread.interrupt_main()` does nothing."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for the module: its tests run worker processes beside the in-process reference
    on a 2-core machine (use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
