"""Experiment: the one-token block-scaled FP8 GEMV on tensor cores against the package's pipelined GEMV, at
Qwen3-4B / Qwen3-32B decode shapes (scales shared by 128-row runs, as checkpoint layers).

`python -m fxrewrite.benchmarks.fp8_gemv_mma --out DIR` (GPU). The package's pipelined GEMV
(`fxrewrite.kernels.fp8_gemv_pipelined`) widens every weight element to float32 and multiply-adds it on the CUDA
cores (about 2.5 instructions an element). Here the same software-pipelined weight stream feeds ``tl.dot``:

- ``mma``: each step's [BLOCK_N, BLOCK_K] e4m3 tile, widened to float16 (exact for e4m3), times x scaled by the
  step's group scales (every row of the tile shares them) and by the inverse of its largest magnitude (so it fits
  float16), laid in row 0 of a [16, BLOCK_K] operand (the MMA's smallest N); the [BLOCK_N, 16] product's column 0,
  times that magnitude, accumulates in float32.

Also times more configs of the pipelined GEMV than the tuner's list (``pipelined:``). Timing as
`benchmarks.gemv.graph_us` (a CUDA graph of 20 calls over enough weight copies to overflow L2); every variant is
first checked against the float32 product with the dequantized weight.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch
import torch.nn.functional as F

from fxrewrite.benchmarks.common import RESULTS_DIR, environment, write_result
from fxrewrite.benchmarks.gemv import _timed, copy_tbps
from fxrewrite.benchmarks.gemv_pipelined import SHAPES
from fxrewrite.benchmarks.out_paths import FOLDER_HELP, results_folder
from fxrewrite.benchmarks.tool_cli import require_cuda
from fxrewrite.kernels.fp8_gemv_pipelined import PIPELINED_CONFIGS, fp8_gemv_pipelined_triton
from fxrewrite.kernels.gemv_tune import max_rel_error, scratch_scales, scratch_weights
from fxrewrite.kernels.triton_utils import tl, triton

PIPELINED_MORE = ((8, 1024, 4, 4), (16, 1024, 4, 8), (32, 512, 4, 8), (32, 256, 5, 4), (8, 512, 6, 4),
                  (16, 512, 6, 4), (16, 512, 4, 8), (16, 256, 8, 4))
MMA_CONFIGS = [(bn, bk, st, wp) for bn in (16, 32, 64) for bk in (128, 256, 512) for st in (3, 5) for wp in (4,)]


@triton.jit
def _gemv_mma_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, N, K, stride_ws_n, stride_ws_g, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * K
    rk = tl.arange(0, BLOCK_K)
    GROUPS: tl.constexpr = BLOCK_K // 128
    rg = tl.arange(0, GROUPS)
    first_scales = ws_ptr + tl.program_id(0) * BLOCK_N * stride_ws_n
    lane = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + rk
        w = tl.load(rows + k[None, :], mask=(k < K)[None, :], other=0.0).to(tl.float16)
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        g = k0 // 128 + rg
        s = tl.load(first_scales + g * stride_ws_g, mask=g * 128 < K, other=0.0)
        x = tl.reshape(tl.reshape(x, (GROUPS, 128)) * s[:, None], (BLOCK_K,))
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-30)
        xb = tl.where(lane[:, None] == 0, (x / amax)[None, :], 0.0).to(tl.float16)  # [16, BLOCK_K], row 0 real
        acc += tl.dot(w, tl.trans(xb)) * amax
    total = tl.sum(acc, axis=1)  # columns 1.. are zero
    tl.store(out_ptr + rn, total.to(out_ptr.dtype.element_ty), mask=rn < N)


def gemv_mma(x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, config: tuple[int, ...]) -> torch.Tensor:
    """x [1, K] bf16, w [N, K] e4m3, w_s [N, K/128] float32 equal in 128-row runs -> [1, N] bf16."""
    block_n, block_k, stages, warps = config
    n, k = w.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_mma_kernel[(triton.cdiv(n, block_n),)](x, w, w_s, out, n, k, w_s.stride(0), w_s.stride(1),
                                                 BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages,
                                                 num_warps=warps)
    return out


def measure(n: int, k: int) -> dict:
    ws = scratch_weights(n, k, "cuda", torch.float8_e4m3fn)
    scales = scratch_scales(n, k, "cuda", rows=128)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x.float(), ws[0].float() * scales.repeat_interleave(128, dim=1)[:, :k])
    arms: dict = {}
    runs = {f"pipelined:{'/'.join(map(str, c))}": (lambda i, c=c: fp8_gemv_pipelined_triton(
        x, ws[i], scales, c, per_channel=False, scale_rows=128)) for c in (*PIPELINED_CONFIGS, *PIPELINED_MORE)}
    runs.update({f"mma:{'/'.join(map(str, c))}": (lambda i, c=c: gemv_mma(x, ws[i], scales, c))
                 for c in MMA_CONFIGS})
    for name, fn in runs.items():
        try:
            err = max_rel_error(fn(0), want)
        except Exception as e:  # noqa: BLE001 - a config this GPU / triton cannot build is reported
            arms[name] = f"error: {type(e).__name__}: {str(e)[:160]}"
            continue
        arms[name] = _timed(fn, len(ws)) if err < 0.02 else f"error: max relative error {err:.3g}"
    nbytes = n * k
    timed = {a: t for a, t in arms.items() if isinstance(t, float)}
    best = {p: min((a for a in timed if a.startswith(p)), key=timed.get, default=None)
            for p in ("pipelined", "mma")}
    listed = min((a for a in timed if a.startswith("pipelined") and tuple(map(int, a.split(":")[1].split("/")))
                  in PIPELINED_CONFIGS), key=timed.get, default=None)
    best["pipelined_listed"] = listed
    return {"N": n, "K": k, "weight_bytes": nbytes, "us": arms,
            "TBps": {a: round(nbytes / (t * 1e-6) / 1e12, 3) for a, t in timed.items()},
            "best": {p: (a, round(timed[a], 2)) for p, a in best.items() if a}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.fp8_gemv_mma",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="qwen3-32b,qwen3-4b")
    parser.add_argument("--out", type=results_folder, default=RESULTS_DIR, help=FOLDER_HELP)
    args = parser.parse_args(argv)
    require_cuda("fp8_gemv_mma")
    date = datetime.date.today().isoformat()
    result = {"date": date, "environment": environment(), "copy_TBps": round(copy_tbps(), 3), "rows": {}}
    for cfg in args.configs.split(","):
        for proj, (n, k) in SHAPES[cfg].items():
            row = measure(n, k)
            result["rows"][f"{cfg} {proj}"] = row
            print(f"{cfg} {proj:13s} " + "  ".join(f"{p} {a} {t}us" for p, (a, t) in row["best"].items()), flush=True)
    write_result(Path(args.out) / f"{date}-fp8-gemv-mma.json", result)
    return result


if __name__ == "__main__":
    main()
