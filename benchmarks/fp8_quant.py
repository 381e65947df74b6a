"""FP8 activation quantization fused into its producer vs the separate kernels (GPU):
`python -m fxrewrite.benchmarks.fp8_quant --out DIR`.

At Qwen3-4B and Qwen3-32B widths and prefill-sized token counts, microseconds per call (a CUDA graph of 20
calls, replayed: `fxrewrite.benchmarks.gemv.graph_us`) of

- ``norm``: RMSNorm with the residual add then the FP8 quantization (``unfused``: `rms_norm` +
  `per_token_quant_fp8` / `per_token_group_quant_fp8`) against `rms_norm_quant_fp8` (``fused``);
- ``silu``: SiLU-and-mul then the quantization against `silu_and_mul_quant_fp8`;

each per token (the row-wise scaled matmul's input) and per 128-column group (the block-scaled GEMMs').
Writes ``<date>-fp8-quant.json`` with `common.environment`.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch

from fxrewrite.benchmarks.out_paths import FOLDER_HELP, results_folder
from fxrewrite.benchmarks.common import RESULTS_DIR, environment, load_bench_config, write_result
from fxrewrite.benchmarks.gemv import graph_us
from fxrewrite.kernels.activation import silu_and_mul
from fxrewrite.kernels.fp8_gemm import per_token_group_quant_fp8
from fxrewrite.kernels.fp8_quant_fused import rms_norm_quant_fp8, silu_and_mul_quant_fp8
from fxrewrite.kernels.fp8_rowwise import per_token_quant_fp8
from fxrewrite.kernels.rms_norm import rms_norm

TOKENS = (256, 2048, 8192)


def _quant(h: torch.Tensor, group_size):
    return per_token_quant_fp8(h) if group_size is None else per_token_group_quant_fp8(h, 128, column_major_scales=True)


def arms(kind: str, m: int, k: int, group_size) -> dict:
    """{"unfused": fn, "fused": fn} for one (kind, M, K, grouping); fn takes an unused copy index."""
    dev, bf16 = "cuda", torch.bfloat16
    if kind == "norm":
        x, r = torch.randn(m, k, device=dev, dtype=bf16), torch.randn(m, k, device=dev, dtype=bf16)
        w = torch.rand(k, device=dev, dtype=bf16) + 0.5
        return {"unfused": lambda i: _quant(rms_norm(x, w, 1e-6, r)[0], group_size),
                "fused": lambda i: rms_norm_quant_fp8(x, w, 1e-6, r, group_size)}
    x = torch.randn(m, 2 * k, device=dev, dtype=bf16)
    return {"unfused": lambda i: _quant(silu_and_mul(x), group_size),
            "fused": lambda i: silu_and_mul_quant_fp8(x, group_size)}


def run(names: list[str], tokens: tuple[int, ...]) -> list[dict]:
    rows = []
    for name in names:
        cfg = load_bench_config(name)["config"]
        for kind, k in (("norm", cfg["hidden_size"]), ("silu", cfg["intermediate_size"])):
            for m in tokens:
                for group_size in (None, 128):
                    us = {arm: round(graph_us(fn, 1), 2) for arm, fn in arms(kind, m, k, group_size).items()}
                    rows.append({"model": name, "kind": kind, "M": m, "K": k,
                                 "scales": "token" if group_size is None else "group128", "us": us,
                                 "speedup": round(us["unfused"] / us["fused"], 3)})
                    print(rows[-1], flush=True)
                torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.fp8_quant", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=results_folder, default=RESULTS_DIR, help=FOLDER_HELP)
    p.add_argument("--configs", default="qwen3-4b,qwen3-32b", help="comma list of bench configs")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma list of token counts")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fxrewrite.benchmarks.fp8_quant needs a CUDA GPU")
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    result = {"environment": environment(), "timing": "CUDA graph of 20 calls, replayed",
              "rows": run(names, tuple(int(t) for t in args.tokens.split(",")))}
    write_result(args.out / f"{datetime.date.today()}-fp8-quant.json", result)
    return result


if __name__ == "__main__":
    main()
