"""Batch-1 decode kernel chain with and without Programmatic Dependent Launch (GPU):
`python -m fxrewrite.benchmarks.decode_chain --out DIR`.

For each bench config (default Qwen3-4B and Qwen3-32B) it builds `--layers` decoder layers of random bf16
weights (each layer its own, so every weight streams from HBM as in a real step) and a paged KV cache
holding a `--context`-token sequence, then captures one CUDA graph of the native model's per-layer decode
kernels at one token:

  qkv_proj (RMSNorm + residual prologue) -> q/k RMSNorm + rotary + cache write -> paged decode (+ merge)
  -> o_proj -> gate_up_proj (RMSNorm + residual prologue) -> down_proj (SiLU-and-mul prologue)

with each projection run the way the load-time tuner (`fxrewrite.kernels.gemv_tune`, run first here at
bucket 1) chose: its fastest GEMV config (skinny, or the pipelined GEMV after the prologue's kernel) or the
unfused kernels + cuBLAS. Arms: ``FXREWRITE_PDL`` off / on, each with down_proj as tuned, as the fastest
skinny config without split-K, and as SiLU-and-mul + cuBLAS. Reported per arm: microseconds per layer,
weight TB/s and the fraction of the device's copy bandwidth (the roofline of a weight-streaming step). The
GEMV variants alone (every config, PDL off and on, M = 1) come from `fxrewrite.benchmarks.gemv.measure`.
Writes ``<date>-decode-chain-<configs>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from fxrewrite.benchmarks.common import (RESULTS_DIR, copy_bandwidth_bytes_per_s, environment, load_bench_config,
                                         replay_ms, write_result)
from fxrewrite.benchmarks.gemv import measure, projections
from fxrewrite.benchmarks.out_paths import FOLDER_HELP, results_folder
from fxrewrite.kernels import gemv_dispatch, gemv_tune
from fxrewrite.kernels.activation import silu_and_mul
from fxrewrite.kernels.paged_decode import paged_decode_triton
from fxrewrite.kernels.qk_norm_rope_cache import qk_norm_rope_cache
from fxrewrite.kernels.rms_norm import rms_norm
from fxrewrite.kernels.skinny_gemv import configs_for

BLOCK_SIZE = 16
EPS = 1e-6


def build(cfg: dict, layers: int, context: int, max_model_len: int, device="cuda", dtype=torch.bfloat16) -> dict:
    """Random weights for `layers` layers (HF config dict `cfg`) and a one-sequence paged KV cache of
    `context` tokens (bf16 on the GPU by default)."""
    dev, dt = device, dtype
    h, d = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    hq, hkv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]

    def weight(n, k):
        return torch.empty(n, k, device=dev, dtype=dt).normal_(0, k ** -0.5)

    blocks = -(-max_model_len // BLOCK_SIZE)
    inv = 1.0 / (cfg.get("rope_theta", 1e6) ** (torch.arange(0, d, 2, device=dev).float() / d))
    freqs = torch.outer(torch.arange(max_model_len, device=dev).float(), inv)
    return {
        "dims": (h, d, hq, hkv, inter),
        "layers": [{"qkv": weight((hq + 2 * hkv) * d, h), "o": weight(h, hq * d), "gate_up": weight(2 * inter, h),
                    "down": weight(h, inter), "ln1": torch.rand(h, device=dev, dtype=dt) + 0.5,
                    "ln2": torch.rand(h, device=dev, dtype=dt) + 0.5, "qn": torch.rand(d, device=dev, dtype=dt) + 0.5,
                    "kn": torch.rand(d, device=dev, dtype=dt) + 0.5,
                    "kc": torch.randn(blocks, BLOCK_SIZE, hkv, d, device=dev, dtype=dt),
                    "vc": torch.randn(blocks, BLOCK_SIZE, hkv, d, device=dev, dtype=dt)} for _ in range(layers)],
        "cos_sin": torch.cat([freqs.cos(), freqs.sin()], dim=-1),
        "positions": torch.tensor([context - 1], device=dev),
        "slots": torch.tensor([context - 1], device=dev),
        "block_table": torch.arange(blocks, device=dev, dtype=torch.int32)[None],
        "seq_lens": torch.tensor([context], device=dev, dtype=torch.int32),
        "qsl": torch.tensor([0, 1], device=dev, dtype=torch.int32),
        "max_model_len": max_model_len,
        "hidden": torch.randn(1, h, device=dev, dtype=dt), "residual": torch.randn(1, h, device=dev, dtype=dt),
    }


def _project(kind: str, x, w, config, norm_weight=None, residual=None):
    """One projection as the model runs it: the GEMV `config` names (skinny, or the tuner's tagged pipelined
    choice: `gemv_dispatch.run`), or (config None) the unfused kernels."""
    if config is not None:
        return gemv_dispatch.run(x, w, None, config, norm_weight=norm_weight, eps=EPS, residual=residual,
                                 silu_mul=kind == "silu")
    if kind == "silu":
        return F.linear(silu_and_mul(x), w)
    if kind == "norm":
        normed, residual = rms_norm(x, norm_weight, EPS, residual)
        return F.linear(normed, w), residual
    return F.linear(x, w)


def layer(m: dict, lw: dict, hidden, residual, choice: dict):
    """One decoder layer's decode kernels; returns (hidden, residual)."""
    h, d, hq, hkv, _ = m["dims"]
    qkv, residual = _project("norm", hidden, lw["qkv"], choice["qkv_proj"], lw["ln1"], residual)
    q, k, v = qkv[:, :hq * d], qkv[:, hq * d:(hq + hkv) * d], qkv[:, (hq + hkv) * d:]
    q, k = qk_norm_rope_cache(m["positions"], q, k, v, lw["qn"], lw["kn"], EPS, d, m["cos_sin"], True, lw["kc"],
                              lw["vc"], m["slots"])
    attn = paged_decode_triton(q.view(1, hq, d), lw["kc"], lw["vc"], m["block_table"], m["seq_lens"], m["qsl"], 1,
                               m["max_model_len"], d ** -0.5)
    o = _project("linear", attn.view(1, hq * d), lw["o"], choice["o_proj"])
    gate_up, residual = _project("norm", o, lw["gate_up"], choice["gate_up_proj"], lw["ln2"], residual)
    return _project("silu", gate_up, lw["down"], choice["down_proj"]), residual


def chain_us(m: dict, choice: dict, pdl: str) -> float:
    """Microseconds per layer of one CUDA graph of every layer, FXREWRITE_PDL=`pdl` while it is captured."""
    os.environ["FXREWRITE_PDL"] = pdl

    def step():
        hidden, residual = m["hidden"], m["residual"]
        for lw in m["layers"]:
            hidden, residual = layer(m, lw, hidden, residual, choice)
        return hidden

    step()  # builds the kernels, allocates split-K counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    us = replay_ms(graph, 10, warmup=3) * 1e3 / len(m["layers"])
    del graph
    return us


def tuned_choice(cfg: dict) -> dict:
    """The tuner's bucket-1 choice per projection (None: unfused kernels + cuBLAS)."""
    shapes = projections(cfg)
    os.environ["FXREWRITE_GEMV"] = "auto"
    gemv_dispatch.clear()
    gemv_tune.tune(set(shapes.values()), "cuda", torch.bfloat16, max_m=1)
    return {p: gemv_dispatch.choose(kind, n, k, 1) for p, (kind, n, k) in shapes.items()}


def run_config(name: str, layers: int, context: int, max_model_len: int, copy: float) -> dict:
    """One bench config's GEMV rows (M = 1, PDL off / on), the tuner's choice and the chain arms."""
    cfg = load_bench_config(name)["config"]
    out: dict = {"gemv_m1": {}, "chain": {}}
    for pdl in ("off", "on"):
        os.environ["FXREWRITE_PDL"] = pdl
        for proj, (kind, n, k) in projections(cfg).items():
            ws = gemv_tune.scratch_weights(n, k, "cuda", torch.bfloat16)
            row = out["gemv_m1"][f"{proj} pdl={pdl}"] = measure(kind, ws, 1)
            print(f"{name} {proj:12s} PDL {pdl:3s}: " + ", ".join(f"{a} {t:.1f}" for a, t in row["us"].items()
                                                               if isinstance(t, float)) + " us", flush=True)
            del ws
    torch.cuda.empty_cache()
    os.environ["FXREWRITE_PDL"] = "off"  # the default: the tuner times what the engine runs
    choice = tuned_choice(cfg)
    row = out["gemv_m1"]["down_proj pdl=off"]["us"]
    plain = {c: row.get("gemv:" + "/".join(map(str, c))) for c in configs_for(1) if len(c) == 3}
    plain = {c: t for c, t in plain.items() if isinstance(t, float)}
    unsplit = min(plain, key=plain.get) if plain else None
    out["choice"] = {p: "/".join(map(str, c)) if c else "cublas" for p, c in choice.items()}
    m = build(cfg, layers, context, max_model_len)
    weight_bytes = sum(m["layers"][0][key].nbytes for key in ("qkv", "o", "gate_up", "down"))
    variants = {"tuned": choice, "down_unsplit": {**choice, "down_proj": unsplit},
                "down_cublas": {**choice, "down_proj": None}}
    for pdl in ("off", "on"):
        for label, ch in variants.items():
            try:
                us = chain_us(m, ch, pdl)
            except Exception as e:  # noqa: BLE001 - one failing arm is reported, the others still run
                out["chain"][f"{label} pdl={pdl}"] = f"error: {type(e).__name__}: {str(e)[:300]}"
                print(f"{name} chain {label} PDL {pdl}: {out['chain'][f'{label} pdl={pdl}']}", flush=True)
                continue
            tbps = weight_bytes / (us * 1e-6) / 1e12
            out["chain"][f"{label} pdl={pdl}"] = {"us_per_layer": round(us, 2), "TBps": round(tbps, 3),
                                                 "roofline_fraction": round(tbps / copy, 3),
                                                 "layers_x_us_ms": round(us * cfg["num_hidden_layers"] / 1e3, 3)}
            print(f"{name} chain {label:12s} PDL {pdl:3s}: {us:7.1f} us/layer, {tbps:.2f} TB/s "
                  f"({tbps / copy:.1%} of copy)", flush=True)
    out["layer_weight_bytes"] = weight_bytes
    del m
    torch.cuda.empty_cache()
    return out


def _compile(jobs: list[tuple]) -> int:
    """Build the GEMV kernels of `jobs` ((pdl, kind, K, config), M = 1) into Triton's disk cache."""
    torch.cuda.init()
    for pdl, kind, k, config in jobs:
        os.environ["FXREWRITE_PDL"] = pdl
        w = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)  # N a multiple of 16, as every real N
        gemv_tune.candidate(kind, w, config=config, **gemv_tune.make_inputs(kind, 1, k, "cuda", torch.bfloat16))
    torch.cuda.synchronize()
    return len(jobs)


def precompile_both(names: list[str], workers: int) -> float:
    """Build every M = 1 GEMV config of the configs' projections, PDL off and on, in `workers` processes
    (one pool for everything: each worker pays one CUDA / Triton start). Returns seconds."""
    start = time.perf_counter()
    jobs = sorted({(pdl, kind, k, config) for name in names for kind, n, k in
                   projections(load_bench_config(name)["config"]).values()
                   for config in gemv_tune.candidates(1, kind, n) for pdl in ("off", "on")},
                  key=repr)  # a tagged (pipelined) config does not compare with an untagged one
    if workers > 1:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_compile, [jobs[i::workers] for i in range(workers)]))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    """Parse the arguments (``--help``), time every config, write the JSON; returns the result dict."""
    p = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.decode_chain",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=results_folder, default=RESULTS_DIR, help=FOLDER_HELP)
    p.add_argument("--configs", default="qwen3-4b,qwen3-32b", help="comma list of bench configs")
    p.add_argument("--layers", type=int, default=12, help="decoder layers in the captured graph (default 12)")
    p.add_argument("--context", type=int, default=256, help="tokens in the KV cache (default 256)")
    p.add_argument("--max-model-len", type=int, default=4096, help="sizes the attention split count (default 4096)")
    p.add_argument("--compile-workers", type=int, default=min(16, os.cpu_count() or 1),
                   help="processes that build the GEMV kernels first (PDL off and on)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fxrewrite.benchmarks.decode_chain needs a CUDA GPU")
    if not 1 <= args.context <= args.max_model_len:
        raise SystemExit(f"--context {args.context}: expected 1..--max-model-len ({args.max_model_len})")
    start = time.perf_counter()
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    compile_s = precompile_both(names, args.compile_workers)
    print(f"GEMV kernels built in {compile_s:.0f} s (PDL off and on)", flush=True)
    copy = copy_bandwidth_bytes_per_s() / 1e12
    result = {"environment": environment(), "copy_TBps": copy, "compile_s": compile_s, "layers": args.layers,
              "context": args.context, "max_model_len": args.max_model_len, "configs": {}}
    path = args.out / f"{datetime.date.today()}-decode-chain-{'-'.join(names)}.json"
    for name in names:  # written after each config: a run cut short keeps what it measured
        result["configs"][name] = run_config(name, args.layers, args.context, args.max_model_len, copy)
        result["elapsed_s"] = time.perf_counter() - start
        write_result(path, result)
    return result


if __name__ == "__main__":
    main()
