"""`greedy_sample`'s kernels against the reference (argmax of the float32 logits, `log_softmax_float32` at it):
the same token, ties to the lowest id, -inf entries, slices that are all -inf, a vocabulary that is not a
multiple of the slice width, bf16 and float32, strided rows; through the interpreter on a CPU, compiled for sm90
without a GPU, and at Qwen3's vocabulary on the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxrewrite.kernels.greedy_sample import (CHUNK, ENV, greedy_sample, greedy_sample_ref, greedy_sample_triton,
                                             kernel_enabled)


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * 4 + 10).to(dtype).to(device)


def _check(got, want) -> None:
    (tokens, packed), (ref_tokens, ref_packed) = got, want
    assert tokens.dtype == torch.int64 and packed.dtype == torch.float64 and packed.shape == ref_packed.shape
    assert torch.equal(tokens.cpu(), ref_tokens.cpu())
    assert torch.equal(packed[:, 0].cpu(), ref_packed[:, 0].cpu())
    torch.testing.assert_close(packed[:, 1].cpu(), ref_packed[:, 1].cpu(), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [CHUNK * 2, CHUNK * 2 + 77, 300])
def test_kernels_match_the_reference(interpret, dtype, vocab):
    x = _logits(3, vocab, dtype, seed=vocab)
    _check(greedy_sample_triton(x), greedy_sample_ref(x))


def test_ties_go_to_the_lowest_id_across_slices(interpret):
    """A maximum in two slices (and twice inside one): the lowest id wins, as torch.argmax's."""
    x = _logits(2, CHUNK * 3, torch.float32)
    x[0, [CHUNK + 5, 2 * CHUNK + 1]] = 100.0
    x[1, [7, 9, 2 * CHUNK]] = 100.0
    tokens, packed = greedy_sample_triton(x)
    assert tokens.tolist() == [CHUNK + 5, 7] == x.argmax(dim=-1).tolist()
    _check((tokens, packed), greedy_sample_ref(x))


def test_masked_logits_and_slices_of_minus_inf_only(interpret):
    x = _logits(2, CHUNK * 3 + 10, torch.float32)
    x[0, : 2 * CHUNK] = float("-inf")  # two whole slices banned: their sums must not turn the row NaN
    x[1, ::3] = float("-inf")
    tokens, packed = greedy_sample_triton(x)
    assert torch.isfinite(packed).all()
    _check((tokens, packed), greedy_sample_ref(x))


def test_strided_rows_and_the_cpu_dispatch(interpret, monkeypatch):
    """Rows of a wider buffer (a graph's logits view) read through their stride; on a CPU `greedy_sample` is the
    reference itself (bitwise), whatever the switch says."""
    monkeypatch.setenv(ENV, "on")
    wide = _logits(4, 1000, torch.bfloat16)
    x = wide[:, :700]
    _check(greedy_sample_triton(x), greedy_sample_ref(x))
    ref = greedy_sample_ref(x)
    got = greedy_sample(x)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_the_switch(interpret, monkeypatch):
    """On (the default) or off; another value is refused naming it (the engine checks it at start)."""
    monkeypatch.delenv(ENV, raising=False)
    assert kernel_enabled()
    monkeypatch.setenv(ENV, "off")
    assert not kernel_enabled()
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(ValueError, match="FXREWRITE_GREEDY_KERNEL='1': expected 'on' or 'off'"):
        kernel_enabled()


def test_bad_layout_is_refused(interpret):
    with pytest.raises(ValueError, match="unit column stride"):
        greedy_sample_triton(_logits(3, 64, torch.float32).t())
    with pytest.raises(ValueError, match="V > 0"):
        greedy_sample_triton(torch.empty(2, 0))


def test_kernels_compile_for_sm90():
    """Compiled for the H200 (no GPU; TRITON_INTERPRET unset in a subprocess): the slice kernel reads the logits in
    16-byte vectors, the merge writes the int64 token and the two float64 columns."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.kernels.sm90_compile", "greedy-sample"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["slice bf16"]["ld_global_v4"] >= 2 and got["slice fp32"]["ld_global_v4"] >= 4, got
    assert got["merge"]["st_b64"] == 3, got


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 256])
def test_qwen3_vocabulary_on_the_gpu(cuda, rows):
    x = _logits(rows, 151936, torch.bfloat16, seed=rows, device="cuda")
    _check(greedy_sample_triton(x), greedy_sample_ref(x))


@pytest.mark.gpu
def test_kernels_in_a_cuda_graph(cuda, monkeypatch):
    """Captured and replayed on new logits (the decode graphs' head runs them so when switched on)."""
    monkeypatch.setenv(ENV, "on")
    x = _logits(4, 151936, torch.bfloat16, device="cuda")
    greedy_sample(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = greedy_sample(x)
    x.copy_(_logits(4, 151936, torch.bfloat16, seed=9, device="cuda"))
    graph.replay()
    _check(out, greedy_sample_ref(x))
