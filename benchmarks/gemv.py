"""Skinny GEMV against cuBLAS at decode shapes (GPU): `python -m fxrewrite.benchmarks.gemv --out DIR`.

For each bench config (default Qwen3-4B and Qwen3-32B) and each decoder projection, as the native model
calls it (qkv_proj and gate_up_proj with the RMSNorm + residual add fused in, o_proj plain, down_proj with
SiLU-and-mul fused in), at M = 1, 2, 4, 8 tokens, in bf16: microseconds per call of

- ``cublas``: ``torch.nn.functional.linear`` alone (the GEMM, no prologue kernel);
- ``unfused``: the prologue's own kernel (RMSNorm with residual / SiLU-and-mul) + ``F.linear``: what the
  model runs without the GEMV (the load-time tuner's baseline, `fxrewrite.kernels.gemv_tune`);
- every candidate config of the skinny GEMV (`fxrewrite.kernels.skinny_gemv.configs_for(M)`), prologue fused
  (``gemv:<block_n>/<block_k>/<warps>[/<split_k>]``), and at M = 1 on float weights every config of the
  software-pipelined GEMV (``gemv:pipelined/<block_n>/<block_k>/<stages>/<warps>``,
  `fxrewrite.kernels.skinny_gemv_pipelined`: the prologue's own kernel, then the pipelined GEMV): the load-time
  tuner's candidates, `gemv_tune.candidates`; a config whose output differs from ``unfused`` by more than
  `gemv_tune.TOLERANCE` is reported as an error. Each row names the fastest of each family (``best_skinny``,
  ``best_pipelined``, ``best_unfused``: the prologue kernel then the plain skinny GEMV) with its time.

Each time is a CUDA graph of 20 calls cycling over enough weight copies to overflow L2 (the weight streams
from HBM, as in a decode step), replayed with `fxrewrite.benchmarks.common.replay_ms`. TB/s = weight bytes /
time. Per config and M the file also gives the per-step estimate: layers x (sum over the four projections of
the faster of GEMV and unfused) against layers x unfused. Writes ``<date>-gemv-<configs>.json`` with the
environment (`common.environment`) and the device's copy bandwidth.

``--formats float,fp8,fp8-channel`` adds FP8 weights (128 x 128 block-scaled / per-channel,
`fxrewrite.kernels.skinny_gemv_fp8`): there ``cublas`` is the FP8 GEMM alone and ``unfused`` the prologue
kernel + the FP8 GEMM, each the backend `fxrewrite.kernels.fp8_tune` picks for that M (tuned first, its
timings kept under ``fp8_tuner``), and a config is checked against the dequantized float32 product. Rows
are keyed ``<proj>@<M>`` (+ `` fp8`` / `` fp8-channel``); TB/s counts the FP8 weight bytes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from fxrewrite.benchmarks.common import RESULTS_DIR, environment, load_bench_config, replay_ms
from fxrewrite.benchmarks.out_paths import FOLDER_HELP, results_folder
from fxrewrite.kernels import fp8_dispatch, fp8_tune
from fxrewrite.kernels.gemv_dispatch import TAGS
from fxrewrite.kernels.gemv_tune import (TOLERANCE, baseline, candidate, candidates, make_inputs, max_rel_error,
                                         reference, scratch_scales, scratch_weights)

TOKENS = (1, 2, 4, 8)
REPS = 20


def projections(cfg: dict) -> dict[str, tuple[str, int, int]]:
    """{projection: (kind, N, K)} of one decoder layer of an HF config dict (TP 1)."""
    h, d = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv, inter = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
    return {"qkv_proj": ("norm", q + 2 * kv, h), "o_proj": ("linear", h, q), "gate_up_proj": ("norm", 2 * inter, h),
            "down_proj": ("silu", h, inter)}


def graph_us(fn, copies: int) -> float:
    """Microseconds per call of fn(i) (i cycles over the weight copies) replayed from one CUDA graph."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(REPS):
            fn(r % copies)
    us = replay_ms(graph, 5, warmup=2) * 1e3 / REPS
    del graph
    return us


def _timed(fn, copies: int):
    try:
        return graph_us(fn, copies)
    except Exception as e:  # noqa: BLE001 - a config this GPU cannot run is reported, not fatal
        return f"error: {type(e).__name__}: {str(e)[:200]}"


def _us(t) -> str:
    return f"{t:.1f}us" if isinstance(t, float) else str(t)


_BLOCK_ROWS = 128  # block-scaled: rows sharing a scale row, as a checkpoint's 128 x 128 blocks on a 128-row part


def _fp8_args(n: int, k: int, fmt: str) -> dict:
    """The skinny GEMV's scale arguments for a weight of format `fmt` ({} for float); block-scaled scales are equal
    in runs of `_BLOCK_ROWS` rows, as a checkpoint layer's."""
    if fmt == "float":
        return {}
    rows = 1 if fmt == "fp8-channel" else _BLOCK_ROWS
    return {"w_scale": scratch_scales(n, k, "cuda", fmt == "fp8-channel", rows), "per_channel": fmt == "fp8-channel"}


def measure(kind: str, ws: list[torch.Tensor], m: int, fmt: str = "float", fp8: dict | None = None) -> dict:
    """One (projection, M) row: us and TB/s per arm, the best GEMV config and its speedup over unfused."""
    n, k = ws[0].shape
    fp8 = fp8 or {}
    args = make_inputs(kind, m, k, ws[0].device, torch.bfloat16)
    plain_x = torch.randn(m, k, device=ws[0].device, dtype=torch.bfloat16)
    want = reference(kind, ws[0], **args, **fp8)
    rows = {} if not fp8 else {"scale_rows": 1 if fp8["per_channel"] else _BLOCK_ROWS}  # the layer's FP8 product
    alone = (lambda i: F.linear(plain_x, ws[i])) if not fp8 else \
        (lambda i: fp8_dispatch.fp8_linear_dispatch(plain_x, ws[i], fp8["w_scale"], per_channel=fp8["per_channel"],
                                                    **rows))
    arms = {"cublas": _timed(alone, len(ws)),
            "unfused": _timed(lambda i: baseline(kind, ws[i], **args, **fp8, **rows), len(ws))}
    for config in candidates(m, kind, n, fmt):
        name = "gemv:" + "/".join(map(str, config))
        try:
            err = max_rel_error(candidate(kind, ws[0], config=config, **args, **fp8), want)
        except Exception as e:  # noqa: BLE001
            arms[name] = f"error: {type(e).__name__}: {str(e)[:200]}"
            continue
        arms[name] = _timed(lambda i, c=config: candidate(kind, ws[i], config=c, **args, **fp8), len(ws)) \
            if err < TOLERANCE else f"error: max relative error {err:.3g} >= {TOLERANCE}"
    nbytes = n * k * ws[0].element_size()
    timed = {a: t for a, t in arms.items() if isinstance(t, float)}
    gemvs = {a: t for a, t in timed.items() if a.startswith("gemv:")}
    best = min(gemvs, key=gemvs.get) if gemvs else None
    def family_of(arm: str) -> str:
        tag = arm.removeprefix("gemv:").split("/")[0]
        return tag if tag in TAGS else "skinny"

    family = {f: {a: t for a, t in gemvs.items() if family_of(a) == f} for f in ("skinny", *TAGS)}
    bests = {f"best_{f}": min(ts.items(), key=lambda a: a[1]) if ts else None for f, ts in family.items()}
    backend = fp8_dispatch.choose(n, k, m, fp8["per_channel"]) if fp8 else "cublas"
    return {"kind": kind, "N": n, "K": k, "M": m, "format": fmt, "gemm_backend": backend, "weight_bytes": nbytes,
            "us": arms, **bests,
            "TBps": {a: round(nbytes / (t * 1e-6) / 1e12, 3) for a, t in timed.items()},
            "best_gemv": best, "speedup_vs_unfused": timed["unfused"] / gemvs[best] if best and "unfused" in timed
            else None}


def run_config(name: str, formats: tuple[str, ...] = ("float",), tokens: tuple[int, ...] = TOKENS) -> dict:
    spec = load_bench_config(name)
    cfg, out = spec["config"], {"rows": {}, "fp8_tuner": {}}
    layers = cfg["num_hidden_layers"]
    for fmt in formats:
        suffix = "" if fmt == "float" else f" {fmt}"
        for proj, (kind, n, k) in projections(cfg).items():
            ws = scratch_weights(n, k, "cuda", torch.bfloat16 if fmt == "float" else torch.float8_e4m3fn)
            fp8 = _fp8_args(n, k, fmt)
            if fp8:  # the FP8 GEMM backend the engine would run at these M: the unfused baseline
                tuned = fp8_tune.tune({(n, k, fp8["per_channel"])}, torch.device("cuda"), torch.bfloat16, tokens)
                out["fp8_tuner"][f"{proj}{suffix}"] = {"@".join(map(str, key[2:3])): t for key, t in tuned.items()}
            for m in tokens:
                row = measure(kind, ws, m, fmt, fp8)
                out["rows"][f"{proj}@{m}{suffix}"] = row
                print(f"{name} {proj:13s}{suffix} M={m}: " + ", ".join(f"{a} {v:.1f}us ({row['TBps'][a]:.2f} TB/s)"
                      for a, v in row["us"].items() if isinstance(v, float)), flush=True)
                print(f"  best: cublas {_us(row['us']['cublas'])}, unfused {_us(row['us']['unfused'])}, skinny "
                      f"{row['best_skinny']}, pipelined {row['best_pipelined']}, prologue kernel + skinny "
                      f"{row['best_unfused']}", flush=True)
            del ws
            torch.cuda.empty_cache()
    out["per_step_ms"] = {}
    for fmt in formats:
        suffix = "" if fmt == "float" else f" {fmt}"
        for m in tokens:
            rows = [out["rows"][f"{p}@{m}{suffix}"] for p in projections(cfg)]
            if not all(isinstance(r["us"]["unfused"], float) for r in rows):
                continue
            unfused = sum(r["us"]["unfused"] for r in rows)
            chosen = sum(min(r["us"]["unfused"], r["us"].get(r["best_gemv"], float("inf"))) for r in rows)
            out["per_step_ms"][f"{m}{suffix}"] = {"unfused": layers * unfused / 1e3, "with_gemv": layers * chosen / 1e3}
    return out


def _compile(jobs: list[tuple[str, int, int, tuple[int, int, int], str]]) -> int:
    """Build the Triton kernels of `jobs` ((kind, K, M, config, format)) into Triton's disk cache: a small N
    (a multiple of 16, like every real N) specialises the kernel as the real shapes do."""
    torch.cuda.init()
    for kind, k, m, config, fmt in jobs:
        w = scratch_weights(16, k, "cuda", torch.bfloat16 if fmt == "float" else torch.float8_e4m3fn)[0]
        try:
            candidate(kind, w, config=config, **make_inputs(kind, m, k, "cuda", torch.bfloat16), **_fp8_args(16, k, fmt))
        except Exception:  # noqa: BLE001 - the sweep reports a config that cannot build
            pass
    torch.cuda.synchronize()
    return len(jobs)


def precompile(names: list[str], workers: int, formats: tuple[str, ...] = ("float",),
               tokens: tuple[int, ...] = TOKENS) -> float:
    """Compile every (kind, K, M, config, format) the sweep will run (M in `tokens`) in `workers` processes
    (Triton compiles one kernel at a time per process; the sweep then loads them from the disk cache). Returns
    seconds. The kernels are built for the current FXREWRITE_PDL (the workers inherit the environment)."""
    start = time.perf_counter()
    jobs = sorted({(kind, k, m, config, fmt) for name in names
                   for kind, n, k in projections(load_bench_config(name)["config"]).values()
                   for fmt in formats for m in tokens for config in candidates(m, kind, n, fmt)},
                  key=repr)  # a tagged (pipelined) config does not compare with an untagged one
    if workers > 1:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_compile, [jobs[i::workers] for i in range(workers)]))
    return time.perf_counter() - start


def copy_tbps() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second) / 1e12, graph-timed."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (graph_us(lambda i: dst.copy_(src), 1) * 1e-6) / 1e12


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.gemv", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=results_folder, default=RESULTS_DIR, help=FOLDER_HELP)
    p.add_argument("--configs", default="qwen3-4b,qwen3-32b", help="comma list of bench configs")
    p.add_argument("--compile-workers", type=int, default=min(16, os.cpu_count() or 1),
                   help="processes that build the Triton kernels first (1: build them as the sweep runs)")
    p.add_argument("--formats", default="float", help="comma list of weight formats: float, fp8, fp8-channel")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma list of token counts (1..8)")
    p.add_argument("--precompile-only", action="store_true",
                   help="only build the kernels into Triton's disk cache (for the engine's load-time tuner)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fxrewrite.benchmarks.gemv needs a CUDA GPU")
    start = time.perf_counter()
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    tokens = tuple(int(t) for t in args.tokens.split(","))
    compile_s = precompile(names, args.compile_workers, formats, tokens)
    print(f"kernels built in {compile_s:.0f} s", flush=True)
    if args.precompile_only:
        return {"compile_s": compile_s}
    result = {"environment": environment(), "copy_TBps": copy_tbps(), "reps_per_graph": REPS, "compile_s": compile_s,
              "formats": list(formats), "configs": {name: run_config(name, formats, tokens) for name in names}}
    result["elapsed_s"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "" if formats == ("float",) else "-" + "-".join(formats)
    path = args.out / f"{datetime.date.today()}-gemv-{'-'.join(names)}{tag}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path} in {result['elapsed_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
