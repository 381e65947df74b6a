"""Where a training step's GPU sits idle, and what Python code the host was running when it launched the kernel
that ended each idle gap: the step's host-bound parts, by call site.

    python -m fxrewrite.benchmarks.train_gaps --arm optimize --config llama-3.1-8b --batch-size 1 [--min-gap-us 20]

One step of the arm (built as :mod:`fxrewrite.benchmarks.train_profile` builds it, after its warm-up) runs under
torch.profiler with CPU and CUDA activities and Python stacks; from its trace: each gap of at least
``--min-gap-us`` between consecutive GPU operations, keyed by the innermost frames (the model's, the library's,
checkpointing's and the optimizer's, not torch's or triton's plumbing) of the Python stack that launched the
operation after the gap. The profiler's own
Python tracing slows the host, so gaps are larger than in an unprofiled step; compare arms, not absolute figures.
Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import tempfile
from pathlib import Path

from fxrewrite.benchmarks.out_paths import FILE_HELP, result_file
from fxrewrite.benchmarks.train_profile import add_step_arguments, make_step, step_spec

_GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
_SKIPPED_FRAMES = ("<", "nn.Module", "torch/", "triton/", "contextlib", "functools", "typing")
_KEPT_TORCH_FRAMES = ("torch/utils/checkpoint", "torch/optim", "torch/autograd/function")


def _kept(name: str) -> bool:
    """A frame that says where in the model or the library a launch came from (not torch's or triton's plumbing)."""
    return name.startswith(_KEPT_TORCH_FRAMES) or not name.startswith(_SKIPPED_FRAMES) and "python3" not in name


def _trace(step) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return json.loads(Path(f.name).read_text())


def _frame(name: str) -> str:
    """``path/to/file.py(123): func`` -> ``file.py:123 func``."""
    where, _, func = name.partition(": ")
    return f"{where.rsplit('/', 1)[-1].replace('(', ':').rstrip(')')} {func}"


def gaps_by_call_site(trace: dict, min_gap_us: float = 20.0, depth: int = 4) -> dict:
    """Sum the device's idle gaps by the Python call site that launched the operation ending each gap."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in _GPU_CATEGORIES), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    python = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "python_function":
            python[e["tid"]].append(e)
    starts = {}
    for tid, frames in python.items():
        frames.sort(key=lambda e: e["ts"])
        starts[tid] = [e["ts"] for e in frames]
    by_site: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    busy = idle = 0.0
    end = gpu[0]["ts"] if gpu else 0.0
    for e in gpu:
        gap = e["ts"] - end
        busy += e["dur"]
        end = max(end, e["ts"] + e["dur"])
        if gap < min_gap_us:
            continue
        idle += gap
        launch = launches.get(e.get("args", {}).get("correlation"))
        site = "(no launch record)"
        if launch is not None:
            frames = python.get(launch["tid"], [])
            upto = bisect.bisect_right(starts.get(launch["tid"], []), launch["ts"])
            stack = [f for f in frames[max(0, upto - 400):upto] if f["ts"] + f["dur"] >= launch["ts"]]
            kept = [_frame(f["name"]) for f in stack if _kept(f["name"])]
            site = " < ".join(reversed(kept[-depth:])) or launch["name"]
        by_site[site] += gap
        count[site] += 1
    span = (end - gpu[0]["ts"]) if gpu else 0.0
    return {"span_ms": round(span / 1e3, 2), "busy_ms": round(busy / 1e3, 2), "idle_ms": round(idle / 1e3, 2),
            "gaps": [[site, round(us / 1e3, 2), count[site]] for site, us in by_site.most_common(25)]}


def main(argv=None) -> int:
    from fxrewrite.benchmarks.common import environment

    parser = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.train_gaps")
    add_step_arguments(parser)
    parser.add_argument("--min-gap-us", type=float, default=20.0)
    parser.add_argument("--out", type=result_file, default=None, help=FILE_HELP)
    args = parser.parse_args(argv)
    bench, spec = step_spec(args)
    result = gaps_by_call_site(_trace(make_step(spec, args.arm)), args.min_gap_us)
    record = {"config": bench["name"], "arm": args.arm, **{k: v for k, v in spec.items() if k != "config"},
              **result, "environment": environment()}
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))
    print(f"{args.arm}: GPU span {result['span_ms']} ms, busy {result['busy_ms']} ms, "
          f"idle (gaps >= {args.min_gap_us:g} us) {result['idle_ms']} ms")
    for site, ms, n in result["gaps"]:
        print(f"  {ms:8.2f} ms x{n:<5} {site}")
    return 0


if __name__ == "__main__":
    from fxrewrite.benchmarks.tool_cli import run_cli

    raise SystemExit(run_cli(main))
