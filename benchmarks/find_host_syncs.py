"""Find what makes the engine's host wait for the GPU: runs a short throughput workload through one arm
with `torch.cuda.set_sync_debug_mode("warn")` and prints each distinct call stack that synchronised,
with how often it did, plus the host time of each step's launch (graph-replayed decode vs eager).

    python -m fxrewrite.benchmarks.find_host_syncs --config qwen3-0.6b --arm after
    # where the host's time goes, by function (cProfile of the timed run; its overhead inflates Python-heavy code)
    python -m fxrewrite.benchmarks.find_host_syncs --config qwen3-4b --arm native --quantization fp8 \
        --kv-cache-dtype fp8 --num-prompts 200 --max-input-len 1024 --max-output-len 1024 --no-sync-debug \
        --cprofile 40 --out benchmarks/results

Async scheduling only hides the host's work when a step's launch never waits for the device; the one
wait that belongs there is `SampledTokens.results()` (an event), which this does not flag.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import json
import pstats
import time
import traceback
import warnings

import torch

from fxrewrite.benchmarks.common import bench_model_dir, environment, load_bench_config, make_llm, run_requests
from fxrewrite.benchmarks.out_paths import results_folder
from fxrewrite.benchmarks.throughput import ThroughputWorkload
from fxrewrite.runtime.engine.sampling_params import SamplingParams


@contextlib.contextmanager
def record_sync_stacks(stacks: collections.Counter, enabled: bool = True):
    """Count, in ``stacks``, each distinct call stack (its last 8 frames) that made the host wait for the device,
    while the block runs (``torch.cuda.set_sync_debug_mode("warn")``; the warnings are recorded, not printed)."""

    def record(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing" not in str(message):  # not set_sync_debug_mode's own notice
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        stacks["\n".join(f"    {f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in frames[-8:])] += 1

    old_show = warnings.showwarning
    with warnings.catch_warnings():
        warnings.showwarning = record
        warnings.simplefilter("always")
        if enabled:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield stacks
        finally:
            if enabled:
                torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old_show


def top_functions(profile: cProfile.Profile, count: int) -> list[dict]:
    """The `count` functions with the most own time: file:line name, calls, own and cumulative seconds."""
    stats = pstats.Stats(profile)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:count]  # (cc, nc, tottime, cumtime)
    return [{"function": f"{file.split('site-packages/')[-1]}:{line} {name}", "calls": nc,
             "own_s": round(tt, 4), "cumulative_s": round(ct, 4)} for (file, line, name), (_, nc, tt, ct, _) in rows]


def find_host_syncs(config: str, arm: str, num_prompts: int, tokenizer_dir=None, max_input_len: int = 512,
                    max_output_len: int = 128, sync_debug: bool = True, cprofile: int = 0,
                    **engine_kwargs) -> dict:
    """Run the workload once (after a 4-request warm-up) and report the launches' host time, the stacks that
    synchronised (`sync_debug`, CUDA's: ignored without a CUDA device) and, with `cprofile` > 0, that many functions
    of the most own time."""
    spec = load_bench_config(config)
    workload = ThroughputWorkload(num_prompts=num_prompts, max_input_len=max_input_len, max_output_len=max_output_len,
                                  min_len=min(ThroughputWorkload.min_len, max_input_len, max_output_len))
    llm = make_llm(arm, bench_model_dir(spec, tokenizer_dir), max_model_len=workload.max_model_len, **engine_kwargs)
    engine, runner = llm.llm_engine, llm.llm_engine.model_runner
    prompts, output_lens = workload.generate()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    run_requests(engine, prompts[:4], params[:4])  # warm-up

    stacks: collections.Counter = collections.Counter()
    launch_ms = {"graph": [], "eager": []}
    slowest = []
    launch = runner.execute_model_async

    def timed(sched, previous=None):
        decode = all(s.num_new_tokens == 1 for s in sched.scheduled)
        t0 = time.perf_counter()
        out = launch(sched, previous)
        ms = (time.perf_counter() - t0) * 1e3
        launch_ms["graph" if decode else "eager"].append(ms)
        slowest.append((round(ms, 2), len(sched.scheduled), sched.num_tokens))
        return out

    runner.execute_model_async = timed
    profile = cProfile.Profile() if cprofile > 0 else None
    try:
        with record_sync_stacks(stacks, enabled=sync_debug and torch.cuda.is_available()):
            if profile is not None:
                profile.enable()
            try:
                stats = run_requests(engine, prompts, params)
            finally:
                if profile is not None:
                    profile.disable()
    finally:
        del runner.execute_model_async
    summary = {k: {"steps": len(v), "total_s": round(sum(v) / 1e3, 3), "mean_ms": round(sum(v) / max(1, len(v)), 3)}
               for k, v in launch_ms.items()}
    summary["slowest (ms, seqs, tokens)"] = sorted(slowest, reverse=True)[:8]
    return {"arm": arm, "elapsed_s": round(stats.elapsed_s, 3), "output_tokens": stats.output_tokens,
            "steps": len(stats.step_end_s), "launch": summary, "sync_stacks": stacks.most_common(12),
            "top_functions": top_functions(profile, cprofile) if profile is not None else []}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.find_host_syncs",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="qwen3-0.6b")
    p.add_argument("--arm", default="after", choices=("before", "after", "native"))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--no-sync-debug", action="store_true", help="only time the launches")
    p.add_argument("--quantization", default=None, choices=("fp8",), help="as bench compare's (default: none)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"))
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="profile the timed run's Python (cProfile) and report the N functions of most own time")
    p.add_argument("--out", default=None, help="a results folder (made if missing) to write the result into as JSON; "
                   "without it nothing is written")
    p.add_argument("--tokenizer-dir", default=None)
    args = p.parse_args(argv)
    if args.cprofile < 0:
        p.error(f"--cprofile {args.cprofile}: expected a count of functions >= 0")
    if not torch.cuda.is_available():  # the launch timings and the sync debug mode are CUDA's
        raise SystemExit("fxrewrite.benchmarks.find_host_syncs needs a CUDA GPU")
    try:
        out_dir = results_folder(args.out) if args.out else None  # made only once the run can go ahead
    except argparse.ArgumentTypeError as e:
        p.error(f"--out: {e}")
    result = find_host_syncs(args.config, args.arm, args.num_prompts, args.tokenizer_dir, args.max_input_len,
                             args.max_output_len, not args.no_sync_debug, args.cprofile,
                             quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    print(f"{args.arm}: {result['elapsed_s']} s; launch host time: {result['launch']}")
    for stack, count in result["sync_stacks"]:
        print(f"-- {count} syncs from:\n{stack}")
    for row in result["top_functions"]:
        print(f"{row['own_s']:9.4f} s own {row['cumulative_s']:9.4f} s cum {row['calls']:8d} calls  {row['function']}")
    if out_dir is not None:
        kv = None if args.kv_cache_dtype == "auto" else f"kv-{args.kv_cache_dtype.replace('_', '-')}"
        tags = "".join(f"-{v}" for v in (args.quantization, kv) if v)
        name = f"host-syncs-{args.config}-{args.arm}{tags}{'-cprofile' if args.cprofile else ''}"
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps({"environment": environment(), "config": args.config, **result}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    from fxrewrite.benchmarks.tool_cli import run_cli

    raise SystemExit(run_cli(main))
