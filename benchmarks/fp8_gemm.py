"""FP8 block-scaled GEMM on the GPU: the Triton kernel vs torch's scaled_mm (cuBLAS 1x128 / 128x128
block scaling) vs the bf16 GEMM, at the linear shapes of Qwen3-4B and Qwen3-32B.

    python -m fxrewrite.benchmarks.fp8_gemm [--out DIR]   # writes <DIR>/<date>-fp8-gemm.json

Per shape (N, K) and token count M: microseconds of the bf16 `F.linear`, of the FP8 GEMM alone and with
the activation quantization (what a layer's forward costs), the weight bandwidth that implies (GB/s, the
decode roofline: the H200's HBM3e is 4.8 TB/s) and the largest relative error against the dequantized
reference. An implementation that torch cannot run on this GPU is recorded with its error.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from fxrewrite.kernels.fp8_gemm import fp8_block_gemm_ref, fp8_block_gemm_triton, per_token_group_quant_fp8

SHAPES = {  # name: (N, K) of the fused projections, TP=1
    "qwen3-4b": {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)},
    "qwen3-32b": {"qkv": (10240, 5120), "o": (5120, 8192), "gate_up": (51200, 5120), "down": (5120, 25600)},
}
TOKENS = (1, 16, 128, 1024, 4096)


def _scaled_mm(q, s, wq, w_blocks):
    """torch's block-scaled FP8 GEMM: activation scales 1x128 (outer-dim major), weight 128x128."""
    a_s = s.t().contiguous().t()
    if hasattr(F, "scaled_mm"):
        st = F.ScalingType
        return F.scaled_mm(q, wq.t(), a_s, st.BlockWise1x128, w_blocks, st.BlockWise128x128,
                           output_dtype=torch.bfloat16)
    return torch._scaled_mm(q, wq.t(), scale_a=a_s, scale_b=w_blocks.t(), out_dtype=torch.bfloat16)


def _time_us(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50)) * 1e3


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def bench_shape(n: int, k: int, m: int) -> dict:
    """Timings (us), weight GB/s and errors of the implementations for one [m, k] x [n, k]^T product."""
    from fxrewrite.layers.fp8_linear import quantize_weight_fp8

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    wq, w_blocks = quantize_weight_fp8(w, (128, 128))
    w_rows = w_blocks.repeat_interleave(128, 0)[:n].contiguous()
    q, s = per_token_group_quant_fp8(x)
    ref = fp8_block_gemm_ref(q, s, wq, w_rows)
    row = {"m": m, "n": n, "k": k, "bf16_us": _time_us(lambda: F.linear(x, w))}
    row["triton_gemm_us"] = _time_us(lambda: fp8_block_gemm_triton(q, s, wq, w_rows))
    row["triton_layer_us"] = _time_us(lambda: fp8_block_gemm_triton(*per_token_group_quant_fp8(x), wq, w_rows))
    row["triton_rel_err"] = _rel_err(fp8_block_gemm_triton(q, s, wq, w_rows), ref)
    try:
        row["scaled_mm_rel_err"] = _rel_err(_scaled_mm(q, s, wq, w_blocks), ref)
        row["scaled_mm_gemm_us"] = _time_us(lambda: _scaled_mm(q, s, wq, w_blocks))
        row["scaled_mm_layer_us"] = _time_us(lambda: _scaled_mm(*per_token_group_quant_fp8(x), wq, w_blocks))
    except Exception as e:  # noqa: BLE001 - recorded: not every torch/cuBLAS build has block scaling
        row["scaled_mm_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    for key in ("bf16_us", "triton_gemm_us", "scaled_mm_gemm_us"):
        if key in row:
            nbytes = n * k * (2 if key == "bf16_us" else 1)
            row[key.replace("_us", "_weight_gbps")] = round(nbytes / row[key] / 1e3, 1)
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
