"""`fxrewrite bench kernels`: each Triton kernel against its torch reference and against the bytes it
must move over the measured device-to-device copy bandwidth (METHOD.md's floor).

Sizes are real-model shapes (Qwen3-4B / Llama-3.1-8B: hidden 4096, 32 q heads, 8 kv heads, head 128),
each input several times the L2. Times are medians of ``triton.testing.do_bench`` (CUDA events).
``run_kernel_bench(out_dir)`` writes ``<out_dir>/<date>-kernels.json`` and returns the same dict;
``python benchmarks/kernels.py --out DIR`` does the same and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path
from typing import Callable

import torch
import transformers

from fxrewrite.benchmarks.common import RESULTS_DIR, cpu_name
from fxrewrite.benchmarks.source_revision import source_revision
from fxrewrite.benchmarks.out_paths import FOLDER_HELP, results_folder
from fxrewrite.errors import UserInputError
from fxrewrite.kernels.activation import _act_and_mul_triton, gelu_and_mul_ref, silu_and_mul_ref
from fxrewrite.kernels.greedy_sample import greedy_sample_ref, greedy_sample_triton
from fxrewrite.kernels.paged_attention import paged_attention_ref
from fxrewrite.kernels.paged_decode import _num_splits, paged_decode_triton
from fxrewrite.kernels.paged_prefill import paged_prefill_triton
from fxrewrite.kernels.reshape_and_cache import reshape_and_cache_ref, reshape_and_cache_triton
from fxrewrite.kernels.rms_norm import rms_norm_ref, rms_norm_triton
from fxrewrite.kernels.rotary import rotary_embedding_ref, rotary_embedding_triton

BF16 = torch.bfloat16
TOKENS, HIDDEN, INTERMEDIATE = 16384, 4096, 11008
VOCAB, SAMPLER_ROWS = 151936, (1, 16, 256)  # Qwen3's vocabulary; greedy sampling at decode batch sizes
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DECODE_CASES = [(1, 32768), (8, 32768), (64, 4096)]  # (sequences, context)
PREFILL_CASES = [("prefill 4x4096", [(0, 4096)] * 4), ("chunked prefill 4x(8192+2048)", [(8192, 2048)] * 4)]
SDPA_LEN = 4096
DEVICE = "cuda"

# Launch knobs tried for the attention kernels; each is also checked against the reference.
DECODE_CONFIGS = [dict(block_n=n, num_warps=w, num_stages=s)
                  for n, w, s in [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 3), (32, 4, 3), (64, 8, 2)]]
PREFILL_CONFIGS = [dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
                   for m, n, w, s in [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 4, 3), (64, 32, 4, 3),
                                      (128, 128, 8, 2), (64, 64, 4, 3)]]


MIN_SPLIT_TOKENS = 256  # the extra split counts tried keep partitions at least this long


def use_cpu_smoke_sizes() -> None:
    """Tiny shapes on the CPU (Triton interpreter; float16, as its bf16 dots are wrong): every code
    path of the bench runs in seconds, so a changed kernel signature breaks a CPU test, not a GPU run."""
    global BF16, TOKENS, HIDDEN, INTERMEDIATE, VOCAB, SAMPLER_ROWS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, DECODE_CASES, PREFILL_CASES
    global SDPA_LEN, DEVICE, DECODE_CONFIGS, PREFILL_CONFIGS, MIN_SPLIT_TOKENS, BLOCK_SIZE
    BF16, DEVICE = torch.float16, "cpu"
    VOCAB, SAMPLER_ROWS = 3000, (1, 4)
    TOKENS, HIDDEN, INTERMEDIATE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 32, 32, 2, 1, 16
    DECODE_CASES, PREFILL_CASES, SDPA_LEN = [(1, 64)], [("prefill 1x(8+8)", [(8, 8)])], 16
    DECODE_CONFIGS, PREFILL_CONFIGS = [dict(block_n=32, num_warps=4, num_stages=2)], [
        dict(block_m=16, block_n=16, num_warps=4, num_stages=2)]
    MIN_SPLIT_TOKENS, BLOCK_SIZE = 16, 4


def _time_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    if DEVICE == "cpu":  # smoke run under TRITON_INTERPRET: one call, wall clock
        import time

        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 4, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * nbytes / (_time_ms(lambda: dst.copy_(src)) * 1e-3)


def _row(name, shape, kernel, ref, nbytes, flops=0.0, bandwidth=1.0, **extra) -> dict:
    """Time ``kernel`` and ``ref``; achieved bandwidth = bytes that must move / kernel time."""
    t_kernel = _time_ms(kernel)
    t_ref = _time_ms(ref) if ref is not None else float("nan")
    gbps = nbytes / (t_kernel * 1e-3) / 1e9
    return dict(name=name, shape=shape, triton_ms=t_kernel, ref_ms=t_ref, speedup=t_ref / t_kernel,
                bytes=nbytes, achieved_GBps=gbps, pct_of_copy=100 * gbps * 1e9 / bandwidth,
                tflops=flops / (t_kernel * 1e-3) / 1e12 if flops else None, **extra)


def _variants(sweeps: dict, name: str, nbytes: int, bw: float, fns: dict) -> None:
    """Time launch variants of one kernel into ``sweeps[name]`` (label -> ms, % of copy)."""
    sweeps[name] = {label: dict(ms=(ms := _time_ms(fn)), pct_of_copy=100 * nbytes / (ms * 1e-3) / bw)
                    for label, fn in fns.items()}
    print(f"  variants {name}: " + "; ".join(f"{k} {v['pct_of_copy']:.0f}%" for k, v in sweeps[name].items()),
          flush=True)


def _sampler_rows(bw: float, sweeps: dict) -> list[dict]:
    """Greedy sampling of bf16 logits [rows, VOCAB]: the two-launch kernel against the general path's ops
    (float copy, log_softmax, argmax, gather). Eager launches: at a few rows both are launch-bound."""
    rows = []
    for n in SAMPLER_ROWS:
        logits = torch.randn(n, VOCAB, device=DEVICE, dtype=BF16)
        rows.append(_row("greedy_sample", f"[{n},{VOCAB}]", lambda: greedy_sample_triton(logits),
                         lambda: greedy_sample_ref(logits), logits.numel() * logits.element_size(), bandwidth=bw))
    return rows


def _elementwise_rows(bw: float, sweeps: dict) -> list[dict]:
    e = 2  # bf16 bytes
    x = torch.randn(TOKENS, HIDDEN, device=DEVICE, dtype=BF16)
    res, w = torch.randn_like(x), torch.randn(HIDDEN, device=DEVICE, dtype=BF16)
    rows = [
        _row("rms_norm", f"[{TOKENS},{HIDDEN}]", lambda: rms_norm_triton(x, w, 1e-6),
             lambda: rms_norm_ref(x, w, 1e-6), 2 * x.numel() * e, bandwidth=bw),
        _row("rms_norm+residual", f"[{TOKENS},{HIDDEN}]", lambda: rms_norm_triton(x, w, 1e-6, res),
             lambda: rms_norm_ref(x, w, 1e-6, res), 4 * x.numel() * e, bandwidth=bw),
    ]
    _variants(sweeps, "rms_norm+residual", 4 * x.numel() * e, bw,
              {f"w{n}": (lambda n=n: rms_norm_triton(x, w, 1e-6, res, num_warps=n)) for n in (4, 8, 16)})
    del x, res
    gu = torch.randn(TOKENS // 2, 2 * INTERMEDIATE, device=DEVICE, dtype=BF16)
    rows += [
        _row("silu_and_mul", f"[{TOKENS // 2},{2 * INTERMEDIATE}]", lambda: _act_and_mul_triton(gu, 0),
             lambda: silu_and_mul_ref(gu), gu.numel() * 3 // 2 * e, bandwidth=bw),
        _row("gelu_and_mul(tanh)", f"[{TOKENS // 2},{2 * INTERMEDIATE}]", lambda: _act_and_mul_triton(gu, 2),
             lambda: gelu_and_mul_ref(gu, "tanh"), gu.numel() * 3 // 2 * e, bandwidth=bw),
    ]
    _variants(sweeps, "silu_and_mul", gu.numel() * 3 // 2 * e, bw,
              {f"b{b}w{n}": (lambda b=b, n=n: _act_and_mul_triton(gu, 0, block=b, num_warps=n))
               for b, n in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (512, 4))})
    del gu
    pos = torch.randint(0, 32768, (TOKENS,), device=DEVICE)
    cache = torch.randn(32768, HEAD_DIM, device=DEVICE)
    q = torch.randn(TOKENS, NUM_HEADS * HEAD_DIM, device=DEVICE, dtype=BF16)
    k = torch.randn(TOKENS, NUM_KV_HEADS * HEAD_DIM, device=DEVICE, dtype=BF16)
    rot_bytes = 2 * (q.numel() + k.numel()) * e + TOKENS * HEAD_DIM * 4
    rows.append(_row("rotary(q,k) neox", f"q[{TOKENS},{NUM_HEADS}x{HEAD_DIM}] k[..,{NUM_KV_HEADS}x]",
                     lambda: rotary_embedding_triton(pos, q, k, HEAD_DIM, cache, True),
                     lambda: rotary_embedding_ref(pos, q, k, HEAD_DIM, cache, True), rot_bytes, bandwidth=bw))
    _variants(sweeps, "rotary neox", rot_bytes, bw,
              {f"w{n}": (lambda n=n: rotary_embedding_triton(pos, q, k, HEAD_DIM, cache, True, num_warps=n))
               for n in (2, 4, 8)})
    _variants(sweeps, "rotary gptj", rot_bytes, bw,
              {f"w{n}": (lambda n=n: rotary_embedding_triton(pos, q, k, HEAD_DIM, cache, False, num_warps=n))
               for n in (4, 8)})
    del q
    kv = torch.randn(TOKENS, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=BF16)
    blocks = TOKENS // BLOCK_SIZE * 2
    kc = torch.empty(blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=BF16)
    vc = torch.empty_like(kc)
    slots = torch.randperm(blocks * BLOCK_SIZE, device=DEVICE)[:TOKENS]
    rows.append(_row("reshape_and_cache", f"[{TOKENS},{NUM_KV_HEADS},{HEAD_DIM}]",
                     lambda: reshape_and_cache_triton(kv, kv, kc, vc, slots),
                     lambda: reshape_and_cache_ref(kv, kv, kc, vc, slots), 4 * kv.numel() * e, bandwidth=bw))
    return rows


def _paged_batch(specs, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM):
    """Random paged batch on the GPU for (cached, query) length pairs; blocks shuffled."""
    seq_lens = [c + q for c, q in specs]
    per_seq = [-(-s // BLOCK_SIZE) for s in seq_lens]
    order = torch.randperm(sum(per_seq), device=DEVICE).to(torch.int32)
    tables = torch.zeros(len(specs), max(per_seq), dtype=torch.int32, device=DEVICE)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = order[used:used + n]
        used += n
    shape = (sum(per_seq), BLOCK_SIZE, num_kv_heads, head_dim)
    kc, vc = (torch.randn(shape, device=DEVICE, dtype=BF16) for _ in range(2))
    q_lens = [q for _, q in specs]
    query = torch.randn(sum(q_lens), num_heads, head_dim, device=DEVICE, dtype=BF16)
    qsl = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).to(torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return (query, kc, vc, tables, sl, qsl, max(q_lens), max(seq_lens)), seq_lens


def _sweep(name, fn, args, ref_out, configs, scale, max_rel_err=2e-2):
    """Time each launch config, check it against the reference (norm-relative error below `max_rel_err`);
    return (best, all)."""
    tried = []
    for cfg in configs:
        try:
            out = fn(*args, scale, **cfg)
            err = float(((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item())
            tried.append(dict(cfg, ms=_time_ms(lambda: fn(*args, scale, **cfg)), rel_err=err))
        except Exception as exc:  # a config may not fit shared memory on this GPU
            tried.append(dict(cfg, error=f"{type(exc).__name__}: {str(exc)[:120]}"))
    ok = [t for t in tried if "ms" in t and t["rel_err"] < max_rel_err]
    best = min(ok, key=lambda t: t["ms"]) if ok else None
    print(f"  sweep {name}: " + "; ".join(f"{t}" for t in tried), flush=True)
    return best, tried


def _attention_rows(bw: float, sweeps: dict) -> list[dict]:
    scale, e, rows = HEAD_DIM ** -0.5, 2, []
    for batch, ctx in DECODE_CASES:
        args, seq_lens = _paged_batch([(ctx - 1, 1)] * batch)
        ref_out = paged_attention_ref(*args, scale)
        best, tried = _sweep(f"decode b{batch} ctx{ctx}", paged_decode_triton, args, ref_out, DECODE_CONFIGS, scale)
        if best:  # more splits than the heuristic's: more loads in flight, more reduce work
            base = {k: best[k] for k in DECODE_CONFIGS[0]}
            splits = _num_splits(batch, NUM_KV_HEADS, ctx)
            more = [dict(base, num_splits=f * splits) for f in (2, 4) if f * splits * MIN_SPLIT_TOKENS <= ctx]
            best2, tried2 = _sweep(f"decode b{batch} ctx{ctx} splits", paged_decode_triton, args, ref_out, more, scale)
            tried += tried2
            best = min([b for b in (best, best2) if b], key=lambda t: t["ms"])
        sweeps[f"decode_b{batch}_ctx{ctx}"] = tried
        cfg = {k: best[k] for k in ("block_n", "num_warps", "num_stages", "num_splits") if k in best} if best else {}
        nbytes = 2 * sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * e + 2 * args[0].numel() * e
        rows.append(_row(f"paged_decode b={batch} ctx={ctx}", f"Hq{NUM_HEADS} Hkv{NUM_KV_HEADS} D{HEAD_DIM}",
                         lambda: paged_decode_triton(*args, scale, **cfg), lambda: paged_attention_ref(*args, scale),
                         nbytes, bandwidth=bw, config=cfg, rel_err=best["rel_err"] if best else None))
    for name, specs in PREFILL_CASES:
        args, seq_lens = _paged_batch(specs)
        ref_out = paged_attention_ref(*args, scale)
        best, tried = _sweep(name, paged_prefill_triton, args, ref_out, PREFILL_CONFIGS, scale)
        sweeps[name] = tried
        cfg = {k: best[k] for k in PREFILL_CONFIGS[0]} if best else {}
        visible = sum(sum(range(c + 1, c + q + 1)) for c, q in specs)  # causal (q, k) pairs
        flops = 4.0 * visible * HEAD_DIM * NUM_HEADS
        nbytes = (2 * sum(seq_lens) * NUM_KV_HEADS + 2 * args[0].shape[0] * NUM_HEADS) * HEAD_DIM * e
        rows.append(_row(name, f"Hq{NUM_HEADS} Hkv{NUM_KV_HEADS} D{HEAD_DIM}",
                         lambda: paged_prefill_triton(*args, scale, **cfg), lambda: paged_attention_ref(*args, scale),
                         nbytes, flops=flops, bandwidth=bw, config=cfg, rel_err=best["rel_err"] if best else None))
    rows.append(_sdpa_peer_row(bw))
    return rows


def _sdpa_peer_row(bw: float) -> dict:
    """torch's own causal SDPA (flash) on dense [4, Hq, SDPA_LEN, D] bf16: the peer for prefill TFLOP/s."""
    import torch.nn.functional as F

    q = torch.randn(4, NUM_HEADS, SDPA_LEN, HEAD_DIM, device=DEVICE, dtype=BF16)
    k = torch.randn(4, NUM_KV_HEADS, SDPA_LEN, HEAD_DIM, device=DEVICE, dtype=BF16)
    fn = lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)  # noqa: E731
    flops = 4.0 * 4 * (SDPA_LEN * (SDPA_LEN + 1) // 2) * HEAD_DIM * NUM_HEADS
    return _row("torch SDPA causal (peer)", f"[4,{NUM_HEADS},{SDPA_LEN},{HEAD_DIM}] dense", fn, None, 0,
                flops=flops, bandwidth=bw)


ROW_GROUPS = {"elementwise": _elementwise_rows, "attention": _attention_rows, "sampler": _sampler_rows}


def run_kernel_bench(out_dir: str | Path, cpu_smoke: bool = False, only: list[str] | None = None) -> dict:
    """Benchmark every kernel on the current CUDA GPU; write ``<out_dir>/<date>-kernels.json``
    (``<date>-kernels-cpu-smoke.json`` with `cpu_smoke`: `use_cpu_smoke_sizes`, needs TRITON_INTERPRET=1).

    Returns ``{"meta": {...}, "copy_GBps": float, "kernels": [row, ...], "sweeps": {...}}`` where
    a row has name, shape, triton_ms, ref_ms, speedup, bytes, achieved_GBps, pct_of_copy, tflops.
    only: the `ROW_GROUPS` to run (default all). Raises UserInputError without a CUDA GPU (or, for the smoke run,
    without the interpreter), or naming a group that does not exist.
    """
    import os

    only = [g.strip() for g in only if g.strip()] if only else None  # "sampler," names one group
    if only == []:
        raise UserInputError(f"no kernel group given; expected some of {sorted(ROW_GROUPS)}")
    unknown = sorted(set(only or ()) - set(ROW_GROUPS))
    if unknown:
        raise UserInputError(f"kernel groups {unknown} do not exist; expected some of {sorted(ROW_GROUPS)}")

    if cpu_smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise UserInputError("--cpu-smoke runs Triton's interpreter: start with TRITON_INTERPRET=1 set")
        use_cpu_smoke_sizes()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise UserInputError("fxrewrite bench kernels needs a CUDA GPU (or --cpu-smoke for a CPU check of the harness)")
    import triton

    torch.manual_seed(0)
    bw = copy_bandwidth(2 << 30 if DEVICE == "cuda" else 1 << 20)
    sweeps: dict = {}
    rows = []
    groups = [g for g in ROW_GROUPS if g in (only or ROW_GROUPS)]  # each group once, in the usual order
    for group in groups:
        rows += ROW_GROUPS[group](bw, sweeps)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    now = datetime.datetime.now(datetime.timezone.utc)
    result = dict(meta=dict(date=now.isoformat(timespec="seconds"),
                            gpu=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter smoke run)",
                            torch=torch.__version__, transformers=transformers.__version__, triton=triton.__version__,
                            python=platform.python_version(), host=platform.node(), cpu=cpu_name(),
                            fxrewrite=source_revision()),  # the commit the figures came from
                  copy_GBps=bw / 1e9, kernels=rows, sweeps=sweeps)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    part = f"-{'-'.join(groups)}" if only else ""  # a partial run must not replace the day's full one
    (out / f"{now:%Y-%m-%d}-kernels{part}{'-cpu-smoke' if cpu_smoke else ''}.json").write_text(json.dumps(_nan_to_null(result), indent=2))
    return result


def _nan_to_null(value):
    """JSON has no NaN (a row without a reference time): null, which strict parsers accept."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _nan_to_null(v) for k, v in value.items()}
    return [_nan_to_null(v) for v in value] if isinstance(value, (list, tuple)) else value


def format_table(result: dict) -> str:
    """The result as a fixed-width text table."""
    lines = [f"{result['meta']['gpu']}  torch {result['meta']['torch']}  triton {result['meta']['triton']}  "
             f"copy {result['copy_GBps']:.0f} GB/s",
             f"{'kernel':34s} {'triton ms':>10s} {'ref ms':>9s} {'x ref':>7s} {'GB/s':>7s} {'% copy':>7s} {'TFLOP/s':>8s}"]
    for r in result["kernels"]:
        tf = f"{r['tflops']:.0f}" if r.get("tflops") else ""
        name = f"{r['name']} {r['shape']}" if r["name"] == "greedy_sample" else r["name"]  # one row per shape
        lines.append(f"{name:34s} {r['triton_ms']:10.4f} {r['ref_ms']:9.3f} {r['speedup']:7.1f} "
                     f"{r['achieved_GBps']:7.0f} {r['pct_of_copy']:7.1f} {tf:>8s}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.kernels",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=results_folder, default=RESULTS_DIR, help=FOLDER_HELP)
    parser.add_argument("--only", type=lambda s: s.split(","), default=None,
                        help=f"comma-separated kernel groups of {sorted(ROW_GROUPS)} (default: all)")
    args = parser.parse_args(argv)
    print(format_table(run_kernel_bench(args.out, only=args.only)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
