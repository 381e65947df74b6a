"""Where a training step's GPU time goes: one arm of ``bench train`` under torch.profiler.

    python -m fxrewrite.benchmarks.train_profile --arm optimize --config qwen3-0.6b --batch-size 8 --seq-len 2048 \
        [--no-gradient-checkpointing] [--steps 2] [--warmup 2] [--sync-debug] [--host-profile] [--out FILE]

The arm is built exactly as in :mod:`fxrewrite.benchmarks.train` (same seed, weights, ids, optimizer); after
``--warmup`` steps (compile happens there), ``--steps`` steps run under the profiler. Written: the device time of
every kernel name summed over those steps (ms per step, launches per step), the wall time per step, and the
step's total device busy time, sorted by time. One arm per process, as the benchmark (Liger patches
module-wide). Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

from fxrewrite.benchmarks.out_paths import FILE_HELP, result_file
from fxrewrite.benchmarks.train import ARMS, _build


def make_step(spec: dict, arm: str):
    """Build ``arm`` as the benchmark does and run ``spec["warmup"]`` steps (compile happens there); returns the
    step function (fresh random ids, forward with labels, backward, fused AdamW)."""
    import torch

    model, runner, _ = _build(spec, arm)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], fused=True)
    gen = torch.Generator().manual_seed(spec["seed"] + 1)

    def step():
        ids = torch.randint(0, model.config.vocab_size, (spec["batch_size"], spec["seq_len"]), generator=gen)
        ids = ids.to(spec["device"])
        runner(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(spec["warmup"]):
        step()
    return step


def _host_profile(step, top: int = 30) -> list:
    """The host's own time (cProfile's tottime, ms) of one step's Python functions, the largest first: where the
    host spends a step whose device sits idle."""
    import cProfile
    import pstats

    import torch

    profiler = cProfile.Profile()
    profiler.runcall(step)
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats
    rows = [[f"{path.split('site-packages/')[-1]}:{line} {name}", round(tt * 1e3, 2), round(ct * 1e3, 2), calls]
            for (path, line, name), (_, calls, tt, ct, _) in stats.items()]
    return sorted(rows, key=lambda r: -r[1])[:top]


def profile_arm(spec: dict, arm: str, steps: int, sync_debug: bool = False, host_profile: bool = False) -> dict:
    """Profile ``steps`` steps of ``arm`` after ``spec["warmup"]``; returns the per-kernel table (ms per step), the
    host's time to enqueue a step (ms; near the wall time when the step is host-bound or waits for the device)
    and, with ``sync_debug``, the call stacks that made the host wait during one more step; with ``host_profile``,
    cProfile's table of one more step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step = make_step(spec, arm)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        host = (time.perf_counter() - t0) / steps
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    stacks: collections.Counter = collections.Counter()
    if sync_debug:
        from fxrewrite.benchmarks.find_host_syncs import record_sync_stacks

        with record_sync_stacks(stacks):
            step()
        torch.cuda.synchronize()
    host_functions = _host_profile(step) if host_profile else []
    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels[event.name[:120]]
            entry[0] += event.device_time_total / 1e3 / steps
            entry[1] += 1 / steps
    table = sorted(([name, round(ms, 3), round(n, 1)] for name, (ms, n) in kernels.items()), key=lambda r: -r[1])
    return {"arm": arm, "wall_ms_per_step": round(wall * 1e3, 2), "host_ms_per_step": round(host * 1e3, 2),
            "device_ms_per_step": round(sum(r[1] for r in table), 2), "kernels": table,
            "sync_stacks": stacks.most_common(12), "host_functions": host_functions}


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments that pick the arm and the step's shape (shared with :mod:`fxrewrite.benchmarks.train_gaps`)."""
    parser.add_argument("--arm", choices=ARMS, required=True)
    parser.add_argument("--config", default="qwen3-0.6b")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--warmup", type=int, default=2)


def step_spec(args) -> tuple[dict, dict]:
    """The bench config and the step's spec from :func:`add_step_arguments`' arguments; UserInputError without
    a CUDA device (the profiles are of the GPU step)."""
    import torch

    from fxrewrite.benchmarks.common import load_bench_config
    from fxrewrite.errors import UserInputError

    if not torch.cuda.is_available():
        raise UserInputError("this profiles a training step on a CUDA device, and torch sees none")

    bench = load_bench_config(args.config)
    return bench, {"config": bench["config"], "dtype": "bfloat16", "device": "cuda", "seed": 0, "lr": 1e-5,
                   "warmup": args.warmup, "batch_size": args.batch_size, "seq_len": args.seq_len,
                   "gradient_checkpointing": not args.no_gradient_checkpointing}


def main(argv=None) -> int:
    from fxrewrite.benchmarks.common import environment

    parser = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.train_profile")
    add_step_arguments(parser)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--sync-debug", action="store_true", help="also record what made the host wait (one step)")
    parser.add_argument("--host-profile", action="store_true", help="also cProfile one step (host time by function)")
    parser.add_argument("--out", type=result_file, required=True, help=FILE_HELP)
    args = parser.parse_args(argv)
    bench, spec = step_spec(args)
    record = {"config": bench["name"], **{k: v for k, v in spec.items() if k != "config"},
              **profile_arm(spec, args.arm, args.steps, args.sync_debug, args.host_profile), "environment": environment()}
    args.out.write_text(json.dumps(record, indent=1))
    print(f"{args.arm}: {record['wall_ms_per_step']} ms/step wall, {record['host_ms_per_step']} ms host, "
          f"{record['device_ms_per_step']} ms device")
    for stack, count in record["sync_stacks"]:
        print(f"-- {count} syncs from:\n{stack}")
    for name, tottime, cumtime, calls in record["host_functions"]:
        print(f"  host {tottime:8.2f} ms own {cumtime:8.2f} ms total x{calls:<6} {name}")
    for name, ms, n in record["kernels"][:25]:
        print(f"  {ms:8.2f} ms  x{n:<6g} {name}")
    return 0


if __name__ == "__main__":
    from fxrewrite.benchmarks.tool_cli import run_cli

    raise SystemExit(run_cli(main))
