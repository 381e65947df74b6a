"""The on-disk compile caches (torch.compile itself runs only on CUDA: tests/gpu/test_gpu_compile.py)."""

from __future__ import annotations

import os

from fxrewrite.runtime.worker.compilation import use_compile_cache


def test_compile_cache_under_fxrewrite_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FXREWRITE_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    root = use_compile_cache()
    assert root == tmp_path / "torch_compile"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(root / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")  # a user's own choice is kept
    use_compile_cache()
    assert os.environ["TRITON_CACHE_DIR"] == "/elsewhere"


def test_compile_cache_replaces_inductors_import_time_default(monkeypatch, tmp_path):
    """Importing torch._inductor sets TORCHINDUCTOR_CACHE_DIR to its /tmp default: that is not a user's choice."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    monkeypatch.setenv("FXREWRITE_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    root = use_compile_cache()
    assert cache_dir() == str(root / "inductor")  # where Inductor's FX graph cache now reads and writes
