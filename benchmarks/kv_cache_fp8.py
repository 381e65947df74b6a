"""Paged decode attention over a bf16 vs an FP8 (e4m3) KV cache (GPU), Qwen3-4B / Llama-3.1-8B heads
(32 q, 8 kv, head 128), blocks of 16 slots in shuffled order, every sequence its own blocks.

For each (sequences, context) case and cache dtype it times each launch config (heads along the MMA's M, then
with the keys there: ``keys_major``; for FP8, with the dots in fp16, for two configs in the query's bf16, and on FP8
tensor cores: ``fp8_dots``) of ``paged_decode_triton``
(``triton.testing.do_bench`` medians) and checks it against the reference over the dequantized cache; the
row gives the best config's time and the bytes it must read (cache + queries + output) over the time, as a
share of the measured copy bandwidth. ``python -m fxrewrite.benchmarks.kv_cache_fp8 --out DIR`` writes
``<date>-kv-cache-fp8.json``; ``--graph-layers 36`` adds rows timed as the engine runs decode (one launch per layer,
each its own cache, replayed in a CUDA graph, the split count of ``--max-model-len``): the sweep's single launches
on L2-cold caches found the keys-major tile faster where the engine found it slower.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fxrewrite.benchmarks import kernels
from fxrewrite.benchmarks.common import RESULTS_DIR, environment, replay_ms
from fxrewrite.benchmarks.out_paths import FOLDER_HELP, results_folder
from fxrewrite.benchmarks.tool_cli import require_cuda
from fxrewrite.kernels.attention_tile import keys_contiguous
from fxrewrite.kernels.paged_attention import paged_attention_ref
from fxrewrite.kernels.paged_decode import paged_decode_triton

CASES = [(200, 560), (64, 2048), (8, 8192), (1, 32768), (1, 256), (1, 2048)]
# The configs that came first or second in one case or another (H200, 2026-12-02-kv-cache-fp8-seventeenth.json).
CONFIGS = [dict(block_n=n, num_warps=w, num_stages=s, keys_major=False)
           for n, w, s in [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2)]]
# Keys along the MMA's M (keys_major; always so with fp8_dots="float8"): wgmma tiles of 64 keys and up.
KEYS_MAJOR_CONFIGS = [dict(block_n=n, num_warps=w, num_stages=s, keys_major=True) for n, w, s in
                      [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2), (256, 8, 2)]]
DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}


def _case_rows(batch: int, ctx: int, bandwidth: float) -> list[dict]:
    args, seq_lens = kernels._paged_batch([(ctx - 1, 1)] * batch)
    scale, rows = kernels.HEAD_DIM ** -0.5, []
    for label, dtype in DTYPES.items():
        cache = tuple(c.to(dtype) for c in args[1:3])
        case = (args[0], *cache, *args[3:])
        want = paged_attention_ref(args[0], *(c.to(torch.bfloat16) for c in cache), *args[3:], scale)
        # the value cache with each block's keys contiguous, read as V^T (attention_tile.value_tile_t)
        case_vt = (case[0], case[1], keys_contiguous(case[2]), *case[3:])
        sweeps = [(label, CONFIGS, 2e-2, case), (f"{label}_keys_major", KEYS_MAJOR_CONFIGS, 2e-2, case),
                  (f"{label}_v_keys_contiguous", KEYS_MAJOR_CONFIGS, 2e-2, case_vt)]
        if dtype.itemsize == 1:
            # e4m3 query and probabilities: about the error of the e4m3 cache itself (attention_tile.py)
            float8 = [dict(c, fp8_dots="float8") for c in KEYS_MAJOR_CONFIGS]
            sweeps = [(label, CONFIGS + [dict(c, fp8_dots="query") for c in CONFIGS[:2]], 2e-2, case), *sweeps[1:],
                      (f"{label}_float8_dots", float8, 8e-2, case),
                      (f"{label}_float8_dots_v_keys_contiguous", float8, 8e-2, case_vt)]
        for row_label, configs, max_err, args_ in sweeps:
            best, tried = kernels._sweep(f"{row_label} b{batch} ctx{ctx}", paged_decode_triton, args_, want, configs,
                                         scale, max_err)
            cache_bytes = 2 * sum(seq_lens) * kernels.NUM_KV_HEADS * kernels.HEAD_DIM * dtype.itemsize
            nbytes = cache_bytes + 2 * args[0].numel() * 2
            ms = best["ms"] if best else None
            rows.append(dict(batch=batch, context=ctx, kv_cache_dtype=row_label, best=best, tried=tried, bytes=nbytes,
                             pct_of_copy=100 * nbytes / (ms * 1e-3) / bandwidth if ms else None))
            print(f"{row_label:9} b={batch:<4} ctx={ctx:<6} {ms and round(ms * 1e3, 1)} us "
                  f"({rows[-1]['pct_of_copy'] and round(rows[-1]['pct_of_copy'])}% of copy) {best}", flush=True)
    return rows


# Engine-like rows (--graph-layers): decode at batch 1 (short and long) and at the throughput workload's batch.
GRAPH_CASES = [(1, 256), (1, 32768), (200, 560)]


def _graph_rows(layers: int, max_model_len: int) -> list[dict]:
    """Decode as the engine replays it: one launch per layer, each layer its own cache, captured in one CUDA graph
    (PDL as `FXREWRITE_PDL` says), the split count from `max_model_len` as in the engine's decode graphs, the
    engine's launch config; heads- vs keys-major tile, and FP8 dots over e4m3. us per layer (graph replay)."""
    rows = []
    scale = kernels.HEAD_DIM ** -0.5
    for batch, ctx in GRAPH_CASES:
        per_layer = [kernels._paged_batch([(ctx - 1, 1)] * batch)[0] for _ in range(layers)]
        for label, dtype in DTYPES.items():
            caches = [(a[0], a[1].to(dtype), a[2].to(dtype), *a[3:7], max_model_len) for a in per_layer]
            caches_vt = [(*a[:2], keys_contiguous(a[2]), *a[3:]) for a in caches]
            forms = [("heads", dict(keys_major=False), caches), ("keys", dict(keys_major=True), caches),
                     ("keys_v_keys_contiguous", {}, caches_vt)]
            if dtype.itemsize == 1:
                forms += [("float8_dots", dict(fp8_dots="float8"), caches),
                          ("float8_dots_v_keys_contiguous", dict(fp8_dots="float8"), caches_vt)]
            for form, knobs, layer_args in forms:
                def step():
                    for args in layer_args:
                        paged_decode_triton(*args, scale, **knobs)
                step()  # the JIT, before capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                us = replay_ms(graph, 20, warmup=3) * 1e3 / layers
                rows.append(dict(batch=batch, context=ctx, kv_cache_dtype=label, form=form, layers=layers,
                                 max_model_len=max_model_len, us_per_layer=us))
                print(f"graph {label:9} {form:12} b={batch:<4} ctx={ctx:<6} {us:.1f} us a layer", flush=True)
                del graph
            del caches, caches_vt, layer_args
        del per_layer
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.kv_cache_fp8",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=results_folder, default=RESULTS_DIR, help=FOLDER_HELP)
    p.add_argument("--no-sweep", action="store_true", help="skip the per-config sweep (only the graph rows)")
    p.add_argument("--graph-layers", type=int, default=0, metavar="N",
                   help="also time N layers' decode launches replayed in a CUDA graph, as the engine runs them")
    p.add_argument("--max-model-len", type=int, default=40960, help="sizes the graph rows' split count")
    args = p.parse_args(argv)
    require_cuda("kv_cache_fp8")
    bandwidth = kernels.copy_bandwidth()
    rows = [] if args.no_sweep else [r for batch, ctx in CASES for r in _case_rows(batch, ctx, bandwidth)]
    graph_rows = _graph_rows(args.graph_layers, args.max_model_len) if args.graph_layers else []
    env = environment()
    result = {**env, "benchmark": "kv_cache_fp8", "copy_bandwidth_GBps": bandwidth / 1e9, "rows": rows,
              "graph_rows": graph_rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{env['date'][:10]}-kv-cache-fp8.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
