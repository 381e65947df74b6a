"""The on-disk compile caches (torch.compile itself runs only on CUDA: tests/gpu/test_gpu_compile.py)."""

from __future__ import annotations

import os

import pytest
import torch

from fxrewrite.runtime.worker.compilation import use_compile_cache
from fxrewrite.runtime.worker.forward_context import forward_context
from fxrewrite.runtime.worker.memory_profiling import _dummy_metadata


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


@pytest.mark.parametrize("tokens, seq_len", [(6, 3), (2, 1)])  # prefill, then two one-token decode rows
def test_paged_attend_op_output_matches_its_fake_for_a_transposed_query(tokens, seq_len):
    """The transformers path hands attention a transposed [1, H, T, D] view; the op's output must still be the
    contiguous [T, H, D] its fake promises (Inductor asserts the strides: a prefill under -O 3 failed so)."""
    heads, kv_heads, head_dim, block_size = 4, 2, 8, 4
    positions, meta, blocks = _dummy_metadata(tokens, seq_len, block_size, torch.device("cpu"))
    meta.kv_caches = [(torch.zeros(blocks, block_size, kv_heads, head_dim),) * 2]
    query = torch.randn(1, heads, tokens, head_dim).transpose(1, 2)[0]  # [T, H, D], strides (D, T * D, 1)
    key, value = torch.randn(2, tokens, kv_heads, head_dim).unbind(0)
    assert not query.is_contiguous()
    with forward_context(meta):
        torch.library.opcheck(torch.ops.fxrewrite.paged_attend, (query, key, value, 0, head_dim ** -0.5),
                              test_utils=("test_schema", "test_faketensor"))
        out = torch.ops.fxrewrite.paged_attend(query, key, value, 0, head_dim ** -0.5)
    assert out.is_contiguous() and out.shape == query.shape
