"""Fused linear cross-entropy: time and memory per chunk size, on the GPU (the cost behind the chunk rule).

    python -m fxrewrite.benchmarks.flce_chunks --tokens 16384 --hidden 1024 --vocab 151936 \
        --chunks 128,256,512,1024,2048

For each rows-per-chunk: forward + backward of :func:`fxrewrite.kernels.fused_linear_cross_entropy.
fused_linear_cross_entropy` (bf16, the Triton kernel path, weight and hidden states requiring grad),
median milliseconds over ``--repeats`` after a warm-up, and the peak memory above the inputs (bytes:
d/dhidden, d/dweight, losses and one [chunk, vocab] logits buffer). JSON to ``--out`` (default
``benchmarks/results/<date>-flce-chunks.json``). Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fxrewrite.benchmarks.out_paths import FILE_HELP, result_file
from fxrewrite.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

__all__ = ["time_chunks"]


def time_chunks(tokens: int, hidden: int, vocab: int, chunks: list[int], repeats: int = 5) -> list[dict]:
    """[{"chunk", "ms", "peak_extra_bytes", "logits_chunk_bytes"}] per chunk size (CUDA, bf16)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    rows = []
    for chunk in chunks:
        times = []
        for i in range(repeats + 1):
            h.grad = w.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            fused_linear_cross_entropy(h, w, None, t, kernel_params=(1.0, None), chunk_size=chunk).backward()
            torch.cuda.synchronize()
            if i:  # the first run compiles / warms up
                times.append((time.perf_counter() - t0) * 1e3)
        rows.append({"chunk": chunk, "ms": statistics.median(times),
                     "peak_extra_bytes": torch.cuda.max_memory_allocated() - base,
                     "logits_chunk_bytes": chunk * vocab * 2})
        print(f"chunk {chunk:5d}: {rows[-1]['ms']:7.2f} ms  peak +{rows[-1]['peak_extra_bytes'] / 2**20:8.1f} MiB")
    return rows


def main(argv=None) -> int:
    """CLI (see the module docstring)."""
    from fxrewrite.benchmarks.common import RESULTS_DIR, environment

    p = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.flce_chunks")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunks", default="128,256,512,1024,2048")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=result_file, default=None, help=FILE_HELP)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():  # it times CUDA kernels
        raise SystemExit("fxrewrite.benchmarks.flce_chunks needs a CUDA GPU")
    rows = time_chunks(args.tokens, args.hidden, args.vocab, [int(c) for c in args.chunks.split(",")], args.repeats)
    out = args.out or Path(RESULTS_DIR) / f"{time.strftime('%Y-%m-%d')}-flce-chunks.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "rows": rows,
                               "environment": environment()}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    from fxrewrite.benchmarks.tool_cli import run_cli

    raise SystemExit(run_cli(main))
