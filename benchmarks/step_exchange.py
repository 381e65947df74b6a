"""The driver <-> worker step exchange: gloo vs the shared-memory queue, alone and in batch-1 decode.

    python -m fxrewrite.benchmarks.step_exchange [--out DIR] [--world-size 2] [--config qwen3-4b]

1. Round trip (no model): the driver sends a decode `StepMessage` of B sequences (what `StepEncoder`
   sends at steady state: B rows, B new tokens, a new block id for every 16th sequence) to `world`
   worker processes, and TP rank 0 answers B `(seq_id, SampleResult)`; median / p90 microseconds over
   ITERS round trips, for each transport (`fxrewrite.runtime.worker.step_channel`).
2. End to end: `LLM(tensor_parallel_size=world)` batch-1 decode tokens/s (`run_latency`) with
   ``FXREWRITE_STEP_TRANSPORT`` = gloo and shm, alternating, --repeats engines each (the median is
   reported beside every run). Without --config (CPU): a tiny random Qwen3 folder; with --config
   (GPU): that bench config's shapes, dummy weights, arm --arm.

Writes `<date>-step-exchange-tp<world>-<device>.json` to the results folder.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

from fxrewrite import distributed
from fxrewrite.benchmarks.common import RESULTS_DIR, bench_model_dir, environment, load_bench_config, make_llm
from fxrewrite.benchmarks.latency import LatencyWorkload, run_latency
from fxrewrite.benchmarks.out_paths import FOLDER_HELP, results_folder
from fxrewrite.runtime.engine.sampler import SampleResult
from fxrewrite.runtime.worker.step_channel import TRANSPORT_ENV, GlooChannel, ShmChannel
from fxrewrite.runtime.worker.step_messages import STEP_FIELDS, StepMessage

BATCH_SIZES = (1, 8, 64, 256)
ITERS = 300
TRANSPORTS = ("gloo", "shm")


def decode_message(batch: int, step: int) -> StepMessage:
    """A steady-state decode step of `batch` sequences (see the module docstring)."""
    rows = np.zeros((batch, len(STEP_FIELDS)), dtype=np.int64)
    rows[:, 0] = np.arange(batch)
    rows[:, 1] = 100 + step  # start
    rows[:, 2] = 1  # one new token
    rows[:, 3] = 1  # one in flight (async scheduling)
    rows[:, 4] = 1  # one host token since the last message
    new_block = np.arange(batch) % 16 == step % 16
    rows[:, 5] = np.where(new_block, 7, 0)
    rows[:, 6] = new_block
    return StepMessage([], [], rows, np.full(batch, 42 + step, dtype=np.int64),
                       np.arange(int(new_block.sum()), dtype=np.int64))


def _worker(local_rank: int, world: int, port: int, transport: str, handles) -> None:
    rank = local_rank + 1
    store = torch.distributed.TCPStore("127.0.0.1", port, world + 1, is_master=False)
    state = distributed.initialize(rank, world + 1, store=store, tp_ranks=list(range(1, world + 1)), with_driver=True)
    sends = rank == state.results_rank
    channel = (ShmChannel.attach(handles, local_rank, sends) if transport == "shm"
               else GlooChannel(state.results_rank, state.driver_group))
    while (msg := channel.recv()) is not None:
        if sends:
            channel.send_result([(int(sid), SampleResult(7, -0.5)) for sid in msg.steps[:, 0]])
    channel.close()
    distributed.destroy()


def round_trips(world: int, transport: str, batch_sizes, iters: int) -> dict:
    """{batch: {"median_us", "p90_us", "message_bytes"}} for one transport."""
    import pickle

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = torch.distributed.TCPStore("127.0.0.1", port, world + 1, is_master=True, wait_for_workers=False)
    shm = ShmChannel.create(world, lambda: True, 60.0) if transport == "shm" else None
    ctx = mp.start_processes(_worker, args=(world, port, transport, shm and shm.handles()), nprocs=world,
                             join=False, start_method="spawn")
    state = distributed.initialize(0, world + 1, store=store, tp_ranks=list(range(1, world + 1)), with_driver=True)
    channel = shm or GlooChannel(state.results_rank, state.driver_group)
    out = {}
    try:
        for batch in batch_sizes:
            times = []
            for i in range(iters + 20):
                msg = decode_message(batch, i)
                start = time.perf_counter()
                channel.send(msg)
                channel.recv_result()
                times.append((time.perf_counter() - start) * 1e6)
            times = sorted(times[20:])
            out[str(batch)] = {"median_us": round(statistics.median(times), 1),
                               "p90_us": round(times[int(0.9 * len(times))], 1),
                               "message_bytes": len(pickle.dumps(decode_message(batch, 0)))}
        channel.send(None)
        ctx.join()
    finally:
        distributed.destroy()
        channel.close()
    return out


def decode_tokens_per_s(transport: str, world: int, model_dir: Path, arm: str | None, output_len: int) -> dict:
    """Batch-1 decode through `LLM(tensor_parallel_size=world)` with the given transport."""
    os.environ[TRANSPORT_ENV] = transport
    workload = LatencyWorkload(batch_sizes=[1], prompt_len=32, output_len=output_len)
    kwargs = {"tensor_parallel_size": world, "max_model_len": workload.max_model_len, "max_num_seqs": 8}
    if arm is None:
        from fxrewrite.runtime.llm import LLM

        llm = LLM(str(model_dir), model_impl="native", device="cpu", **kwargs)
    else:
        llm = make_llm(arm, model_dir, **kwargs)
    try:
        assert llm.llm_engine.model_runner.step_transport == transport
        return run_latency(llm, workload)["batch_1"]
    finally:
        llm.llm_engine.model_runner.shutdown()
        os.environ.pop(TRANSPORT_ENV, None)


def _model_dir(config: str | None, tmp: str) -> Path:
    if config is not None:
        return bench_model_dir(load_bench_config(config))
    from fxrewrite.runtime.model_files.demo import build_model_dir

    return build_model_dir(Path(tmp) / "tiny-qwen3", "qwen3", hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab="smollm2")


def end_to_end(args, transports: list[str]) -> dict:
    """Batch-1 decode, gloo and shm alternating, `args.repeats` engines each (see the module docstring)."""
    runs = {t: [] for t in transports}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(args.config, tmp)
        output_len = args.output_len or (128 if args.config else 48)
        arm = args.arm if args.config else None
        for _ in range(args.repeats):
            for t in transports:
                runs[t].append(decode_tokens_per_s(t, args.world_size, model_dir, arm, output_len))
    out = {"model": args.config or "tiny qwen3 (hidden 64, 2 layers, CPU)", "arm": arm or "native",
           "output_len": output_len}
    for t, rows in runs.items():
        rates = [row["decode_tokens_per_s"] for row in rows]
        out[t] = {"decode_tokens_per_s_median": statistics.median(rates), "runs": rows}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.step_exchange",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=results_folder, default=RESULTS_DIR, help=FOLDER_HELP)
    parser.add_argument("--world-size", type=int, default=2, help="tensor-parallel workers (default 2)")
    parser.add_argument("--config", default=None, help="bench config for the end-to-end part (GPU); "
                        "default: a tiny random model on the CPU")
    parser.add_argument("--arm", default="after", choices=("before", "after", "native"))
    parser.add_argument("--iters", type=int, default=ITERS, help=f"round trips per batch size (default {ITERS})")
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)), help="round-trip batch sizes")
    parser.add_argument("--output-len", type=int, default=None, help="decode tokens (default 128 GPU, 48 CPU)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="gloo,shm (default both)")
    parser.add_argument("--repeats", type=int, default=3, help="engines per transport (default 3)")
    parser.add_argument("--skip-e2e", action="store_true", help="the round trip only")
    args = parser.parse_args(argv)
    for name in ("world_size", "iters", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be a positive integer")
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--batch-sizes {args.batch_sizes!r}: expected comma-separated positive integers")
    if not batch_sizes or min(batch_sizes) < 1:
        parser.error(f"--batch-sizes {args.batch_sizes!r}: expected comma-separated positive integers")
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if not transports or set(transports) - set(TRANSPORTS):
        parser.error(f"--transports {args.transports!r}: expected a comma-separated subset of gloo,shm")
    env = environment()
    env["load_average_1min"] = os.getloadavg()[0]  # CPU runs share the machine: read numbers against it
    result = {"name": "step-exchange", "date": env["date"], "environment": env, "world_size": args.world_size,
              "round_trip": {t: round_trips(args.world_size, t, batch_sizes, args.iters) for t in transports}}
    for batch in batch_sizes:
        print(f"batch {batch:4d} round trip: " + "  ".join(
            f"{t} {result['round_trip'][t][str(batch)]['median_us']:8.1f} us" for t in transports))
    if not args.skip_e2e:
        e2e = result["decode_batch_1"] = end_to_end(args, transports)
        print("batch-1 decode tokens/s (median): " + "  ".join(
            f"{t} {e2e[t]['decode_tokens_per_s_median']}" for t in transports))
    device = "gpu" if args.config else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{env['date'][:10]}-step-exchange-tp{args.world_size}-{device}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    from fxrewrite.benchmarks.tool_cli import run_cli

    raise SystemExit(run_cli(main))
