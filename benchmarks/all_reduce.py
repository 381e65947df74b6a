"""All-reduce latency at tensor-parallel message sizes: NCCL vs symmetric memory, inside CUDA graphs.

    python -m fxrewrite.benchmarks.all_reduce [--out DIR]      # on a machine with >= 2 GPUs

One process per GPU (spawn). Each size is checked first (symmetric-memory sum == NCCL sum, random
bf16 data), then timed as a CUDA graph of 64 back-to-back all-reduces replayed 20 times (median per
all-reduce, microseconds). Writes `<date>-all-reduce-tp<N>.json` to the results folder.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fxrewrite.benchmarks.out_paths import FOLDER_HELP, results_folder
from fxrewrite.benchmarks.common import RESULTS_DIR, environment
from fxrewrite.symm_all_reduce import SymmMemAllReduce

SIZES = (2560, 5120, 2560 * 8, 5120 * 64, 2560 * 256, 4 << 20)
"""Elements: a Qwen3-4B / 32B hidden row at batch 1, batch 8, 64 and 256 decode rows, a 8 MiB prefill chunk."""
GRAPH_CALLS, REPLAYS = 64, 20


def _time_graph(fn, x: torch.Tensor) -> float:
    """Median microseconds per call of `fn(x)` over CUDA-graph replays of GRAPH_CALLS calls."""
    for _ in range(3):
        fn(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn(x)
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / GRAPH_CALLS)
    return sorted(times)[len(times) // 2]


def _worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    device = torch.device("cuda", rank)
    symm = SymmMemAllReduce.create(dist.group.WORLD, device, torch.bfloat16)
    rows = []
    for n in SIZES:
        x = torch.randn(n, dtype=torch.bfloat16, device=device, generator=torch.Generator(device).manual_seed(rank))
        expect = x.clone()
        dist.all_reduce(expect)
        row = {"elements": n, "bytes": n * 2, "nccl_us": _time_graph(lambda t: dist.all_reduce(t), x.clone())}
        if symm is not None and symm.can_run(x):
            got = symm(x.clone())
            row["max_abs_diff_vs_nccl"] = (got.float() - expect.float()).abs().max().item()
            row["symm_mem_us"] = _time_graph(symm, x.clone())
        rows.append(row)
    if rank == 0:
        queue.put({"symm_mem_available": symm is not None, "rows": rows})
    dist.barrier()
    dist.destroy_process_group()


def run(world: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, port, queue), nprocs=world, start_method="spawn")
    return queue.get()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.all_reduce",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=results_folder, default=RESULTS_DIR, help=FOLDER_HELP)
    parser.add_argument("--world-size", type=int, default=None, help="GPUs (default: all visible)")
    args = parser.parse_args(argv)
    world = args.world_size or torch.cuda.device_count()
    if world < 2:
        raise SystemExit(f"needs at least 2 GPUs, found {torch.cuda.device_count()}")
    env = environment()
    result = {"name": "all-reduce", "date": env["date"], "environment": env, "world_size": world, **run(world)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{env['date'][:10]}-all-reduce-tp{world}.json"
    path.write_text(json.dumps(result, indent=1))
    for row in result["rows"]:
        print(f"{row['bytes']:>10d} B  nccl {row['nccl_us']:7.1f} us  symm {row.get('symm_mem_us', float('nan')):7.1f} us"
              f"  diff {row.get('max_abs_diff_vs_nccl', float('nan')):.3g}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    from fxrewrite.benchmarks.tool_cli import run_cli

    raise SystemExit(run_cli(main))
