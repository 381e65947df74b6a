"""FP8 linear layers on the GPU, every backend against the bf16 GEMM, timed by CUDA-graph replay.

    python -m fxrewrite.benchmarks.fp8_gemm [--models qwen3-32b,qwen3-4b] [--tokens 1,8,64,256] [--out DIR]
    # writes <DIR>/<date>-fp8-gemm.json and prints one line per (layer, M, backend)

Per layer shape (N, K) and token count M: microseconds per call of the bf16 `F.linear` (cuBLAS) and of
each FP8 backend of `fxrewrite.kernels.fp8_dispatch` as the layer runs it (activation quantization
included; the weight-only ``gemv:<i>`` kernels quantize nothing), plus torch's scaled_mm with 128 x 128
weight block scales (``scaled_mm_block``, not used by the layers) and, on the per-channel quantization
of the same weight (what ``quantization="fp8"`` on a bf16 checkpoint stores), ``scaled_mm_rowwise``
(per-token activation scales, torch._scaled_mm row-wise) and ``triton_rowwise:<i>`` (the Triton row-wise
GEMM), each also as ``<name>/gemm`` on activations quantized beforehand (what runs after a producer that
writes FP8, RMSNorm or SiLU-and-mul); their errors are against their own dequantized weight; and the
per-channel layers' tuner pick (``channel_pick``); the weight bandwidth each implies
(GB/s over the weight bytes: the decode roofline; the H200's HBM3e peaks at 4.8 TB/s), its max error
relative to the largest output of the float32 product of the unquantized activations and the
dequantized weight, and the backend the engine's load-time tuner (fp8_tune.py) picks for that M. Times
come from one CUDA graph of 20 calls cycling over weight copies that overflow the L2 cache (what decode
runs: no Python launch overhead, weights from HBM; the first version of this benchmark timed eager
calls, whose launch overhead hid the kernels at small M). A backend that cannot run records its error.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from fxrewrite.benchmarks.out_paths import FOLDER_HELP, results_folder
from fxrewrite.benchmarks.tool_cli import require_cuda
from fxrewrite.kernels import fp8_dispatch, fp8_tune
from fxrewrite.kernels.fp8_gemm import per_token_group_quant_fp8
from fxrewrite.kernels.fp8_rowwise import per_token_quant_fp8
from fxrewrite.kernels.fp8_scaled_mm import fp8_scaled_mm, weight_block_scales_for_scaled_mm
from fxrewrite.layers.fp8_linear import quantize_weight_fp8, quantize_weight_fp8_per_channel

SHAPES = {  # name: (N, K) of the fused projections, TP=1
    "qwen3-4b": {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)},
    "qwen3-32b": {"qkv": (10240, 5120), "o": (5120, 8192), "gate_up": (51200, 5120), "down": (5120, 25600)},
}
TOKENS = (1, 8, 64, 256)
_L2 = 128 << 20


def _weights(n: int, k: int):
    """bf16 copies, FP8 copies (enough of each to overflow L2), per-row scales (strides (1, N)), the
    checkpoint-layout block scales, the float32 dequantized weight of copy 0, and the per-channel
    quantization of copy 0: (FP8 copies, [N, G] scales with equal columns, float32 dequantized)."""
    bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            for _ in range(max(1, min(8, -(-_L2 // (2 * n * k)))))]
    wq, blocks = quantize_weight_fp8(bf16[0], (128, 128))
    fp8 = [wq] + [wq.clone() for _ in range(max(1, min(8, -(-_L2 // (n * k)))) - 1)]
    rows = blocks.repeat_interleave(128, 0)[:n].t().contiguous().t()
    wf = wq.float() * rows.repeat_interleave(128, 1)[:, :k]
    cq, cs = quantize_weight_fp8_per_channel(bf16[0])
    channel = ([cq] + [cq.clone() for _ in fp8[1:]], cs[:, None].expand(n, rows.shape[1]).t().contiguous().t(),
               cq.float() * cs[:, None])
    return bf16, fp8, rows, blocks, wf, channel


def bench_shape(n: int, k: int, m: int, weights) -> list[dict]:
    """One row per backend: us, weight GB/s and max relative error at [m, k] x [n, k]^T."""
    bf16, fp8, rows, blocks, wf, (cfp8, cscales, cwf) = weights
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ wf.t()
    block_scales = weight_block_scales_for_scaled_mm(blocks)

    def scaled_mm_block(i):
        q, s = per_token_group_quant_fp8(x, column_major_scales=True)
        return fp8_scaled_mm(q, s, fp8[i], block_scales)

    fns = {"bf16": (lambda i: F.linear(x, bf16[i]), len(bf16), 2)}
    for name in fp8_tune.candidates(n, k, m):
        fns[name] = (lambda i, name=name: fp8_dispatch.fp8_linear_dispatch(  # rows: one scale per 128-row block
            x, fp8[i], rows, backend=name, scale_rows=128), len(fp8), 1)
    fns["scaled_mm_block"] = (scaled_mm_block, len(fp8), 1)
    refs, q, s = {}, *per_token_quant_fp8(x)
    for name in filter(fp8_dispatch.per_channel_only, fp8_tune.candidates(n, k, m, per_channel=True)):
        fns[name] = (lambda i, name=name: fp8_dispatch.fp8_linear_dispatch(
            x, cfp8[i], cscales, backend=name, per_channel=True), len(cfp8), 1)
        fns[name + "/gemm"] = (lambda i, name=name: fp8_dispatch.run_quantized(  # what a fused producer leaves
            q, s, cfp8[i], cscales, torch.bfloat16, name, per_channel=True), len(cfp8), 1)
        refs[name] = refs[name + "/gemm"] = x.float() @ cwf.t()
    out = []
    for name, (fn, copies, elem) in fns.items():
        row = {"m": m, "n": n, "k": k, "backend": name}
        try:
            want = refs.get(name, ref)
            row["max_rel_err"] = float((fn(0).float() - want).abs().max() / want.abs().max())
            row["us"] = round(fp8_tune.graph_time_us(fn, 20, copies), 2)
            row["weight_gbps"] = round(n * k * elem / row["us"] / 1e3, 1)
        except Exception as e:  # noqa: BLE001 - recorded: not every torch/cuBLAS build runs every backend
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out.append(row)
    return out


def main(models=("qwen3-32b",), tokens=TOKENS, out_dir: Path | None = None) -> Path:
    from fxrewrite.benchmarks.common import RESULTS_DIR, environment

    require_cuda("fp8_gemm")
    rows, picks = [], {}
    for model in models:
        for layer, (n, k) in SHAPES[model].items():
            weights = _weights(n, k)
            fp8_dispatch.clear()
            tuned = fp8_tune.tune({(n, k), (n, k, True)}, torch.device("cuda"),
                                  buckets=tuple(sorted({fp8_dispatch.bucket_of(m) for m in tokens})))
            for m in tokens:
                pick = fp8_dispatch.choose(n, k, m)
                b = fp8_dispatch.bucket_of(m)
                picks[f"{model}/{layer}/M={m}"] = {"pick": pick, "tuner": tuned.get((n, k, b)),
                                                   "channel_pick": fp8_dispatch.choose(n, k, m, per_channel=True),
                                                   "channel_tuner": tuned.get((n, k, b, True))}
                for row in bench_shape(n, k, m, weights):
                    row.update(model=model, layer=layer, tuner_pick=row["backend"] == pick)
                    print(f"{model:10s} {layer:8s} M={m:<5d} {row['backend']:16s} "
                          + (f"{row['us']:9.2f} us {row['weight_gbps']:8.1f} GB/s err {row['max_rel_err']:.2e}"
                             if "us" in row else row["error"][:120]) + ("  <- tuner" if row["tuner_pick"] else ""),
                          flush=True)
                    rows.append(row)
            del weights
            torch.cuda.empty_cache()
    out_dir = Path(out_dir or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{datetime.date.today().isoformat()}-fp8-gemm.json"
    path.write_text(json.dumps({"environment": environment(), "timing": "CUDA graph replay, 20 calls, L2-cold weights",
                                "rows": rows, "tuner": picks}, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.fp8_gemm",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3-32b", help="comma-separated keys of SHAPES")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts M")
    parser.add_argument("--out", type=results_folder, default=None, help=FOLDER_HELP)
    args = parser.parse_args()
    main(tuple(args.models.split(",")), tuple(int(t) for t in args.tokens.split(",")), args.out)
