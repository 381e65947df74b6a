"""FP8 block-scaled GEMM on the GPU: the Triton kernel vs torch's scaled_mm (cuBLAS 1x128 / 128x128
block scaling) vs the bf16 GEMM, at the linear shapes of Qwen3-4B and Qwen3-32B.

    python -m fxrewrite.benchmarks.fp8_gemm [--out DIR]   # writes <DIR>/<date>-fp8-gemm.json

Per shape (N, K) and token count M: microseconds of the bf16 `F.linear` (cuBLAS), of the activation
quantization, and of each FP8 GEMM: the Triton kernel with the first tile table (``triton_old``), the
retuned table (``triton_new``) and the tuner's alternative configs (``triton_alt<i>``), the
matrix-vector kernel at M <= 16 (``gemv<i>``), torch's
scaled_mm with 128 x 128 weight blocks (``scaled_mm_block``) and with per-row weight scales
(``scaled_mm_rows``, what the engine's layers use); the weight bandwidth each implies (GB/s, the decode
roofline: the H200's HBM3e is 4.8 TB/s), its max relative error against the dequantized float32
reference, the fastest FP8 path's speed-up over bf16 (quantization included) and the backend the
engine's load-time tuner picks (``layer_backend``). An implementation torch cannot run is recorded
with its error.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from fxrewrite.kernels import fp8_dispatch
from fxrewrite.kernels.fp8_gemm import (
    ALT_CONFIGS,
    OLD_CONFIGS,
    config_for,
    fp8_block_gemm_ref,
    fp8_block_gemm_triton,
    per_token_group_quant_fp8,
)
from fxrewrite.kernels.fp8_gemv import GEMV_CONFIGS, GEMV_MAX_M, fp8_block_gemv_triton
from fxrewrite.kernels.fp8_scaled_mm import fp8_scaled_mm, row_scales_for_scaled_mm, weight_block_scales_for_scaled_mm

SHAPES = {  # name: (N, K) of the fused projections, TP=1
    "qwen3-4b": {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)},
    "qwen3-32b": {"qkv": (10240, 5120), "o": (5120, 8192), "gate_up": (51200, 5120), "down": (5120, 25600)},
}
TOKENS = (1, 16, 64, 128, 256, 1024, 4096)


def _time_us(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50)) * 1e3


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| relative to the largest |want| (max rel error, scale-free)."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _gemms(q, s_col, wq, w_rows, w_blocks_mm, w_rows_mm, m: int) -> dict:
    """name -> a zero-argument callable computing [m, n] in bf16 (what bench_shape times and checks)."""
    gemms = {
        "triton_old": lambda: fp8_block_gemm_triton(q, s_col, wq, w_rows, config=config_for(m, OLD_CONFIGS)),
        "triton_new": lambda: fp8_block_gemm_triton(q, s_col, wq, w_rows),
        "scaled_mm_block": lambda: fp8_scaled_mm(q, s_col, wq, w_blocks_mm),
        "scaled_mm_rows": lambda: fp8_scaled_mm(q, s_col, wq, w_rows_mm, per_row=True),
    }
    for i, cfg in enumerate(ALT_CONFIGS):
        gemms[f"triton_alt{i}"] = lambda cfg=cfg: fp8_block_gemm_triton(q, s_col, wq, w_rows, config=cfg)
    if m <= GEMV_MAX_M:
        for i, (block_n, target) in enumerate(GEMV_CONFIGS):
            gemms[f"gemv{i}"] = lambda b=block_n, t=target: fp8_block_gemv_triton(q, s_col, wq, w_rows,
                                                                                   block_n=b, target_programs=t)
    return gemms


def bench_shape(n: int, k: int, m: int) -> dict:
    """Timings (us), weight GB/s and max rel errors (vs the dequantized float32 reference) of every
    implementation for one [m, k] x [n, k]^T product; a failing one is recorded with its error."""
    from fxrewrite.layers.fp8_linear import quantize_weight_fp8

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    wq, w_blocks = quantize_weight_fp8(w, (128, 128))
    w_rows = w_blocks.repeat_interleave(128, 0)[:n].contiguous()
    q, s_col = per_token_group_quant_fp8(x, column_major_scales=True)
    ref = fp8_block_gemm_ref(q, s_col, wq, w_rows, out_dtype=torch.float32)
    row = {"m": m, "n": n, "k": k, "bf16_us": _time_us(lambda: F.linear(x, w)),
           "bf16_rel_err": _rel_err(F.linear(x, w), ref), "quant_us": _time_us(lambda: per_token_group_quant_fp8(x))}
    gemms = _gemms(q, s_col, wq, row_scales_for_scaled_mm(w_rows), weight_block_scales_for_scaled_mm(w_blocks),
                   row_scales_for_scaled_mm(w_rows), m)
    for name, fn in gemms.items():
        try:
            row[f"{name}_rel_err"] = _rel_err(fn(), ref)
            row[f"{name}_us"] = _time_us(fn)
            row[f"{name}_weight_gbps"] = round(n * k / row[f"{name}_us"] / 1e3, 1)
        except Exception as e:  # noqa: BLE001 - recorded: not every torch/cuBLAS build has block scaling
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    row["bf16_weight_gbps"] = round(n * k * 2 / row["bf16_us"] / 1e3, 1)
    fp8 = {name: row[f"{name}_us"] for name in gemms if f"{name}_us" in row}
    row["fastest_fp8"] = min(fp8, key=fp8.get)
    row["fastest_fp8_speedup_vs_bf16"] = round(row["bf16_us"] / (fp8[row["fastest_fp8"]] + row["quant_us"]), 3)
    fp8_dispatch.clear()
    fp8_dispatch.tune({(n, k)}, torch.device("cuda"), buckets=(fp8_dispatch.bucket_of(m),))
    row["layer_backend"] = fp8_dispatch.choose(n, k, m)  # what the engine's load-time tuner picks
    return row


def main(out_dir: Path | None = None) -> Path:
    from fxrewrite.benchmarks.common import RESULTS_DIR, environment

    rows = []
    for model, layers in SHAPES.items():
        for layer, (n, k) in layers.items():
            for m in TOKENS:
                row = {"model": model, "layer": layer, **bench_shape(n, k, m)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    out_dir = Path(out_dir or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{datetime.date.today().isoformat()}-fp8-gemm.json"
    path.write_text(json.dumps({"environment": environment(), "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    main(parser.parse_args().out)
