"""Where a decode step's GPU time goes, kernel by kernel (torch.profiler over CUDA graph replays and
eager forwards of one decode batch), plus the LM head + sampler that run after the graph.

    python -m fxrewrite.benchmarks.profile_decode --config qwen3-4b --arm native --batch 1 --out DIR
    python -m fxrewrite.benchmarks.profile_decode --config qwen3-4b --arm after --batch 1,64,256 -O 3

Writes DIR/<date>-<config>-<arm>[-O<level>]-b<batch>-decode-profile.json for each batch size (one engine serves
them all) and prints the top kernels per step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from fxrewrite.benchmarks.common import RESULTS_DIR, bench_model_dir, environment, load_bench_config, make_llm
from fxrewrite.benchmarks.latency import graph_forward_fields
from fxrewrite.benchmarks.out_paths import FOLDER_HELP, results_folder
from fxrewrite.benchmarks.tool_cli import json_object_argument
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.sequence import Sequence
from fxrewrite.runtime.engine_config import KV_CACHE_DTYPES
from fxrewrite.runtime.worker.compilation import COMPILED_FORWARD_ENV, forwards_of
from fxrewrite.runtime.worker.cuda_graphs import MAX_CAPTURE_SIZE
from fxrewrite.runtime.worker.forward_context import forward_context

STEPS = 20


def _kernel_table(prof, steps: int, top: int = 25) -> list[dict]:
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us <= 0 or getattr(e, "device_type", None) is None or "CUDA" not in str(e.device_type):
            continue
        rows.append({"kernel": e.key[:120], "calls_per_step": round(e.count / steps, 2),
                     "us_per_step": round(us / steps, 2)})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


def _profile(fn, steps: int = STEPS) -> tuple[list[dict], float]:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    table = _kernel_table(prof, steps, top=40)
    return table, round(sum(r["us_per_step"] for r in _kernel_table(prof, steps, top=10_000)), 1)


def _timed_ms(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / iters, 4)


@torch.inference_mode()  # under -O 3 the graphs' buffers are inference tensors (cuda_graphs.py)
def profile_decode(config: str, arm: str, batches: list[int], context: int, engine_kwargs: dict,
                   tokenizer_dir=None) -> Iterator[dict]:
    """One result dict per batch size in `batches` (see `_profile_batch`), each as soon as it is measured, all
    from one engine."""
    spec = load_bench_config(config)
    llm = make_llm(arm, bench_model_dir(spec, tokenizer_dir), max_model_len=4096, max_num_seqs=max(8, *batches),
                   **engine_kwargs)
    for batch in batches:
        yield _profile_batch(llm, spec, arm, batch, context)


def _profile_batch(llm, spec: dict, arm: str, batch: int, context: int) -> dict:
    runner = llm.llm_engine.model_runner
    graphs = runner.graph_runner
    bs = min(s for s in graphs.sizes if s >= batch)
    blocks = -(-context // runner.block_size)
    graphs.slot_mapping.fill_(-1)  # write no KV
    graphs.seq_lens[:bs] = context
    graphs.block_tables[:bs, :blocks] = torch.arange(blocks, dtype=torch.int32, device=runner.device)
    graphs.input_ids[:bs] = 1
    graphs.positions[:bs] = context - 1
    metadata = graphs._metadata(bs)
    metadata.max_seq_len = context

    def eager():  # a step outside the graphs runs the model runner's step forward (under -O 3 the faster one)
        with forward_context(metadata), forwards_of(runner.step_forward):
            runner.model(graphs.input_ids[:bs], graphs.positions[:bs])

    seqs = [Sequence(f"p{i}", [1] * 8, SamplingParams(temperature=0)) for i in range(batch)]
    hidden = graphs.outputs[:batch]

    def head_and_sampler():
        runner.sampler.sample(runner.model.compute_logits(hidden), seqs)

    graph = graphs.graphs[bs]
    graph_table, graph_us = _profile(graph.replay)
    eager_table, eager_us = _profile(eager)
    return {
        "date": datetime.date.today().isoformat(), "environment": environment(), "config": spec["name"],
        "arm": arm, "batch": batch, "bucket": bs, "context": context,
        "graph_replay_ms": _timed_ms(graph.replay), "graph_has_lm_head": bs in graphs.heads,
        **graph_forward_fields(graphs, bs),
        "eager_forward_ms": _timed_ms(eager),
        "lm_head_and_sampler_ms": _timed_ms(head_and_sampler),
        "graph_kernels_us_per_step": graph_us, "graph_top_kernels": graph_table,
        "eager_kernels_us_per_step": eager_us, "eager_top_kernels": eager_table,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.profile_decode",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="qwen3-4b")
    p.add_argument("--arm", default="native", choices=("before", "after", "native"))
    p.add_argument("--batch", type=_batch_sizes, default=[1], help="sequences per decode step, or a comma list")
    p.add_argument("--context", type=int, default=256, help="tokens already in each sequence's KV cache")
    p.add_argument("-O", "--compilation-config", type=int, default=0)
    p.add_argument("--quantization", default=None, choices=("fp8",), help="as the engine's --quantization (default: none)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="as the engine's --kv-cache-dtype")
    p.add_argument("--hf-overrides", type=json_object_argument, default=None,
                   help="as the engine's --hf-overrides (JSON), e.g. an FP8 checkpoint's quantization_config")
    p.add_argument("--tokenizer-dir", default=None)
    p.add_argument("--out", type=results_folder, default=RESULTS_DIR, help=FOLDER_HELP)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():  # it profiles CUDA graph replays
        raise SystemExit("fxrewrite.benchmarks.profile_decode needs a CUDA GPU")
    engine_kwargs = {"compilation_config": args.compilation_config, "quantization": args.quantization,
                     "kv_cache_dtype": args.kv_cache_dtype, "hf_overrides": args.hf_overrides}
    results = profile_decode(args.config, args.arm, args.batch, args.context, engine_kwargs, args.tokenizer_dir)
    block = (args.hf_overrides or {}).get("quantization_config")
    tag = "-fp8" if args.quantization else "-fp8-block" if block else ""
    tag += f"-kv{args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else ""
    tag += f"-O{args.compilation_config}" if args.compilation_config else ""
    forced = os.environ.get(COMPILED_FORWARD_ENV, "auto")  # which forwards a compiled model may run
    tag += f"-{forced}" if args.compilation_config and forced != "auto" else ""
    for result in results:
        result["quantization"], result["kv_cache_dtype"] = args.quantization, args.kv_cache_dtype
        result["hf_overrides"], result["compilation_config"] = args.hf_overrides, args.compilation_config
        result["compiled_forward"] = forced
        path = args.out / f"{result['date']}-{result['config']}-{args.arm}{tag}-b{result['batch']}-decode-profile.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"{args.config} {args.arm}{tag} batch {result['batch']}: graph ({result['graph_forward']} forward) "
              f"{result['graph_replay_ms']} ms, eager "
              f"{result['eager_forward_ms']} ms, LM head + sampler {result['lm_head_and_sampler_ms']} ms")
        for name in ("graph", "eager"):
            print(f"-- {name}: {result[f'{name}_kernels_us_per_step']} us of kernels per step")
            for r in result[f"{name}_top_kernels"][:18]:
                print(f"  {r['us_per_step']:9.2f} us  x{r['calls_per_step']:<6} {r['kernel']}")
        print(f"wrote {path}")
    return 0


def _batch_sizes(text: str) -> list[int]:
    """argparse type of --batch: "1" or "1,64,256" -> [1] / [1, 64, 256] (sorted, each once); each a positive int
    no larger than the largest CUDA graph bucket (MAX_CAPTURE_SIZE, 1024)."""
    try:
        sizes = sorted({int(part) for part in text.split(",")})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1 or sizes[-1] > MAX_CAPTURE_SIZE:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive int or a comma list of them, e.g. 1,64,256, "
                                         f"each at most {MAX_CAPTURE_SIZE} (the largest CUDA graph bucket)")
    return sizes


if __name__ == "__main__":
    from fxrewrite.benchmarks.tool_cli import run_cli

    raise SystemExit(run_cli(main))
