"""The software-pipelined one-token FP8 GEMV (kernels/fp8_gemv_pipelined.py) against the dequantized float32
product, per-channel and block-scaled (scales per element or shared by a tile's rows), through the Triton
interpreter; its place among the FP8 backends (tuned at one token only, weight-only, never handed quantized
activations). Its speed is measured on the GPU
(benchmarks/gemv_pipelined.py; tests/gpu/test_gpu_fp8_gemv_pipelined.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxrewrite.kernels import fp8_dispatch, fp8_tune
from fxrewrite.kernels.fp8_gemm import per_token_group_quant_fp8_ref
from fxrewrite.kernels.fp8_gemv import fp8_weight_only_gemv_ref
from fxrewrite.kernels.fp8_gemv_pipelined import PIPELINED_CONFIGS, fp8_gemv_pipelined_triton


def _weight(n: int, k: int, seed: int, per_channel: bool = True):
    """FP8 weight [n, k] with scales [n, ceil(k/128)] stored outer-dim major, as the FP8 layers keep them:
    per-channel (one scale per row, repeated over the 128-column groups) or one per row and group."""
    gen = torch.Generator().manual_seed(seed)
    if per_channel:
        w = torch.randn(n, k, generator=gen)
        s = w.abs().amax(1, keepdim=True) / 448
        wq, scales = (w / s).to(torch.float8_e4m3fn), s.expand(n, -(-k // 128))
    else:
        wq, scales = per_token_group_quant_fp8_ref(torch.randn(n, k, generator=gen))
    return wq, scales.t().contiguous().t()


@pytest.mark.parametrize("per_channel", [True, False], ids=["channel", "block"])
@pytest.mark.parametrize("n, k", [(40, 640), (24, 1024), (7, 384)])  # partial row tile / K past the last tile
@pytest.mark.parametrize("config", [PIPELINED_CONFIGS[0], PIPELINED_CONFIGS[2], (16, 128, 2, 4)], ids=str)
def test_matches_dequantized_product(interpret, per_channel, n, k, config):
    wq, scales = _weight(n, k, seed=n + k, per_channel=per_channel)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(dtype)
        want = fp8_weight_only_gemv_ref(x, wq, scales, out_dtype=torch.float32)
        got = fp8_gemv_pipelined_triton(x, wq, scales, config, per_channel)
        assert got.dtype == dtype and got.shape == (1, n)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_reads_only_the_first_scale_column(interpret):
    """The reduced sum is multiplied by column 0 of the scales: the other columns are never read."""
    wq, scales = _weight(16, 512, seed=1)
    poisoned = scales.clone()
    poisoned[:, 1:] = float("nan")
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(0))
    got = fp8_gemv_pipelined_triton(x, wq, poisoned, PIPELINED_CONFIGS[0])
    want = fp8_weight_only_gemv_ref(x, wq, scales, out_dtype=torch.float32)
    # float32 sums of 512 products in another order: the tolerance scales with them, as in the test above (a fixed
    # 1e-5 failed by 1.3e-5 on an unseeded x whose output sat near zero); a NaN read from the poison fails at once
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _row_blocks(scales: torch.Tensor, rows: int) -> torch.Tensor:
    """The scales with every aligned run of `rows` rows equal to its first row (outer-dim major, as stored)."""
    blocked = scales[::rows].repeat_interleave(rows, dim=0)[: scales.shape[0]]
    return blocked.t().contiguous().t()


@pytest.mark.parametrize("config", [PIPELINED_CONFIGS[0], PIPELINED_CONFIGS[1], PIPELINED_CONFIGS[4]], ids=str)
@pytest.mark.parametrize("scale_rows", [16, 128, 4])  # 4: below block_n 8 / 16, the per-element path
def test_block_scales_shared_by_a_tile(interpret, config, scale_rows):
    """Block-scaled weights whose scales repeat over aligned runs of `scale_rows` rows (checkpoint layers): where
    the run covers the row tile, the kernel scales x by the tile's first row; the product is the same."""
    wq, scales = _weight(40, 640, seed=4, per_channel=False)
    scales = _row_blocks(scales, scale_rows)
    x = torch.randn(1, 640, generator=torch.Generator().manual_seed(5))
    got = fp8_gemv_pipelined_triton(x, wq, scales, config, per_channel=False, scale_rows=scale_rows)
    want = fp8_weight_only_gemv_ref(x, wq, scales, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_shared_scales_read_only_the_tiles_first_row(interpret):
    """With scale_rows covering the tile, rows 1.. of each tile's scales are never read (NaN there changes
    nothing): the promise, not the data, picks the path."""
    wq, scales = _weight(32, 512, seed=6, per_channel=False)
    scales = _row_blocks(scales, 16)
    poisoned = scales.clone()
    poisoned[1::16] = float("nan")
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(7))
    got = fp8_gemv_pipelined_triton(x, wq, poisoned, PIPELINED_CONFIGS[1], per_channel=False, scale_rows=16)
    want = fp8_weight_only_gemv_ref(x, wq, scales, out_dtype=torch.float32)
    # float32 sums of 512 products in another order: 1e-5 of the largest output (an absolute 1e-5 failed once)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert fp8_gemv_pipelined_triton(x, wq, poisoned, PIPELINED_CONFIGS[1], per_channel=False).isnan().any()


def test_refuses_what_it_cannot_run():
    wq, scales = _weight(8, 256, seed=2)
    with pytest.raises(ValueError, match=r"x \[1, K\]"):
        fp8_gemv_pipelined_triton(torch.randn(2, 256), wq, scales, PIPELINED_CONFIGS[0])
    with pytest.raises(ValueError, match=r"scales \(4, 2\); expected .* \(8, 2\)"):
        fp8_gemv_pipelined_triton(torch.randn(1, 256), wq, scales[:4], PIPELINED_CONFIGS[0])
    with pytest.raises(ValueError, match="block_k 192"):
        fp8_gemv_pipelined_triton(torch.randn(1, 256), wq, scales, (8, 192, 3, 4))


@pytest.mark.parametrize("per_channel", [True, False], ids=["channel", "block"])
def test_one_token_backend_only(interpret, monkeypatch, per_channel):
    """A candidate of the one-token bucket only; chosen there, it runs the layer's scale form, larger M never runs
    it and a GEMM on quantized activations gets the Triton GEMM instead (the kernel has no W8A8 form)."""
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    name = f"{fp8_dispatch.PIPELINED}:1"
    assert name in fp8_tune.candidates(5120, 25600, 1, per_channel=per_channel)
    assert not any(c.startswith(fp8_dispatch.PIPELINED) for c in fp8_tune.candidates(5120, 25600, 2, per_channel))
    assert fp8_dispatch.weight_only(name, 1) and not fp8_dispatch.weight_only(name, 2)
    wq, scales = _weight(32, 256, seed=3, per_channel=per_channel)
    fp8_dispatch.clear()
    try:
        fp8_dispatch.record(32, 256, 1, [name], per_channel=per_channel)
        assert fp8_dispatch.input_quantization(32, 256, 1, per_channel) is None  # the producer writes bf16
        x = torch.randn(3, 256)
        one = fp8_dispatch.fp8_linear_dispatch(x[:1], wq, scales, per_channel=per_channel)
        torch.testing.assert_close(one, fp8_weight_only_gemv_ref(x[:1], wq, scales, out_dtype=torch.float32),
                                   rtol=1e-5, atol=1e-5)
        assert fp8_dispatch.choose(32, 256, 1, per_channel) == name  # it ran: not demoted after an error
        forced = fp8_dispatch.fp8_linear_dispatch(x, wq, scales, backend=name, per_channel=per_channel)  # 3: triton
        torch.testing.assert_close(forced, fp8_dispatch.fp8_linear_dispatch(x, wq, scales, backend="triton"))
        q, s = per_token_group_quant_fp8_ref(x[:1])
        gemm = fp8_dispatch.fp8_gemm_dispatch(q, s.t().contiguous().t(), wq, scales, torch.float32, backend=name)
        torch.testing.assert_close(gemm, fp8_dispatch.fp8_gemm_dispatch(q, s.t().contiguous().t(), wq, scales,
                                                                         torch.float32, backend="triton"))
    finally:
        fp8_dispatch.clear()


def test_compiles_for_sm90_with_the_weight_loads_pipelined():
    """Through triton's real compiler for an H100/H200 (no GPU here; a fresh process, as this one may interpret):
    the loop's loads are cp.async copies into shared memory (the skinny GEMVs have none), the property its speed
    rests on; built with PDL, it sends its first weight lines towards L2 before waiting on the previous kernel."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.kernels.sm90_compile", "fp8-gemv-pipelined"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    loads = json.loads(done.stdout.splitlines()[-1])
    assert loads["channel"]["cp_async"] > 0 and loads["block"]["cp_async"] > 0, loads
    assert all(form["prefetch_before_wait"] > 0 for form in loads.values()), loads

