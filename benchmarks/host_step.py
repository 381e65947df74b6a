"""Host (Python) milliseconds per engine step in steady decode with N running sequences, model compute left out.

Why: on an H200 a small model's decode step (Qwen3-0.6B, 256 sequences) is bound by the engine's own
host work per step (scheduling, input preparation, appending tokens, stop checks, outputs), not by the
GPU. On a CPU the real model's LM head and sampler over a 151k vocabulary would hide that work, so this
benchmark gives `LLMEngine` a stub model runner: it runs the engine's real `prepare_inputs` (the host
half of a launch) and returns a `PendingStep` whose `SampledTokens` hold precomputed greedy tokens (the
host half of reading a step back: `SampledTokens.results`), with async scheduling as on a GPU. Everything
else is the product engine: scheduler, block manager, `_launch`, `_complete`, detokenizers, outputs.

Workloads: "final_only" (what `LLM.generate` submits: one RequestOutput per request, when it finishes), "stream"
(what the server submits: a RequestOutputKind.DELTA output per request every step, joined into the cumulative
snapshot its handlers read, `runtime/server/step_outputs.OutputJoiner`, timed in "loop") and "cumulative" (a
CUMULATIVE output per request every step, the server's kind before DELTA). All greedy, ignore_eos, detokenize
on, no logprobs. Each repeat times `steps` engine steps, after `warmup` steps of decode with every sequence
running; per phase, ms per step; the figures are the median over repeats ("loop" is the whole window: steps plus
reading the outputs).

    python -m fxrewrite.benchmarks.host_step --out benchmarks/results --name 2026-12-05-host-step-before
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fxrewrite.benchmarks.common import environment
from fxrewrite.benchmarks.out_paths import FOLDER_HELP, results_folder
from fxrewrite.benchmarks.tool_cli import count_argument
from fxrewrite.runtime.engine.block_table_cache import BlockTableCache
from fxrewrite.runtime.engine.inputs import prepare_inputs
from fxrewrite.runtime.engine.llm_engine import LLMEngine
from fxrewrite.runtime.engine.sampler import SampledTokens
from fxrewrite.runtime.engine.sampling_params import RequestOutputKind, SamplingParams
from fxrewrite.runtime.engine_config import EngineConfig
from fxrewrite.runtime.gc_passes import fewer_gc_passes
from fxrewrite.runtime.model_files.demo import build_model_dir
from fxrewrite.runtime.server.step_outputs import OutputJoiner
from fxrewrite.runtime.worker.model_runner import PendingStep

PHASES = ("schedule", "launch", "prepare_inputs", "complete", "step", "loop")


class _Timer:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def wrap(self, phase: str, fn):
        seconds = self.seconds

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[phase] += time.perf_counter() - t

        return timed


class StubRunner:
    """The model runner's host side only: `prepare_inputs`, then precomputed greedy tokens (never EOS)."""

    supports_async = True
    pipeline_depth = 1
    device = torch.device("cpu")

    def __init__(self, num_blocks: int, block_size: int, max_seqs: int, timer: _Timer) -> None:
        self.num_blocks, self.block_size, self.timer = num_blocks, block_size, timer
        rows = torch.arange(max_seqs, dtype=torch.int64)
        # a few token patterns in rotation (ids 100..999: plain text tokens, so detokenizing is realistic)
        self._tokens = [(rows * 7 + 13 * k) % 900 + 100 for k in range(8)]
        self._step = 0
        self.table_cache = BlockTableCache()  # as the model runner keeps one

    def sleep_status(self):
        return None  # awake

    def execute_model_async(self, sched, previous=None, bitmask_hook=None) -> PendingStep:
        rows = previous.rows if previous is not None else None
        t = time.perf_counter()
        inputs = prepare_inputs(sched.scheduled, self.block_size, self.device, rows, self.table_cache)
        self.timer.seconds["prepare_inputs"] += time.perf_counter() - t
        seqs = inputs.sample_seqs
        tokens = self._tokens[self._step % len(self._tokens)][: len(seqs)]
        self._step += 1
        packed = torch.stack([tokens.double(), torch.full((len(seqs),), -1.0, dtype=torch.float64)], dim=1)
        return PendingStep(sched, SampledTokens(seqs, tokens, packed))


KINDS = {"final_only": RequestOutputKind.FINAL_ONLY, "stream": RequestOutputKind.DELTA,
         "cumulative": RequestOutputKind.CUMULATIVE}


def run_workload(model_dir: str, num_seqs: int, prompt_len: int, steps: int, warmup: int, repeats: int,
                 workload: str) -> dict:
    """Median ms per engine step per phase over `repeats` windows of `steps` steps."""
    max_len = prompt_len + warmup + steps * repeats + 64
    config = EngineConfig.from_kwargs(model=model_dir, dtype="float32", max_model_len=max_len, max_num_seqs=num_seqs,
                                      max_num_batched_tokens=max(8192, num_seqs * prompt_len), load_format="dummy")
    timer = _Timer()
    blocks = num_seqs * (-(-max_len // config.block_size) + 1)
    engine = LLMEngine(config, model_runner=StubRunner(blocks, config.block_size, num_seqs, timer))
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_len - prompt_len,
                            output_kind=KINDS[workload])
    joiner = OutputJoiner() if workload == "stream" else None  # the server's AsyncLLMEngine keeps one
    for i in range(num_seqs):
        prompt = [100 + (i * 31 + j * 17) % 900 for j in range(prompt_len)]
        engine.add_request(str(i), prompt, params)
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    engine._launch = timer.wrap("launch", engine._launch)
    engine._complete = timer.wrap("complete", engine._complete)
    step = timer.wrap("step", engine.step)
    windows = []
    with fewer_gc_passes():
        for _ in range(warmup):
            step()
        if len(engine.scheduler.running) != num_seqs:
            raise RuntimeError(f"{len(engine.scheduler.running)} of {num_seqs} sequences running after warmup")
        for _ in range(repeats):
            timer.seconds.update(dict.fromkeys(PHASES, 0.0))
            finished = 0
            t = time.perf_counter()
            for _ in range(steps):  # LLM._run's loop
                for output in step():
                    if joiner is not None:
                        output = joiner.snapshot(output)
                    if output.finished:
                        finished += 1
            timer.seconds["loop"] = time.perf_counter() - t
            if finished:
                raise RuntimeError("a request finished inside the measured window")
            windows.append({k: 1000 * v / steps for k, v in timer.seconds.items()})
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    median = {k: round(statistics.median(w[k] for w in windows), 4) for k in PHASES}
    # launch includes prepare_inputs (called by the runner) and the stub's own few tensor ops
    median["launch_excl_prepare_inputs"] = round(median["launch"] - median["prepare_inputs"], 4)
    return {"ms_per_step": median, "repeats": [{k: round(v, 4) for k, v in w.items()} for w in windows]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.host_step",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=results_folder, required=True, help=FOLDER_HELP)
    ap.add_argument("--name", default=None, help="file name stem (default: <date>-host-step)")
    ap.add_argument("--num-seqs", type=count_argument, default=256)
    ap.add_argument("--prompt-len", type=count_argument, default=32)
    ap.add_argument("--steps", type=count_argument, default=200, help="engine steps per repeat")
    ap.add_argument("--warmup", type=count_argument, default=20)
    ap.add_argument("--repeats", type=count_argument, default=5)
    ap.add_argument("--workloads", default="final_only,stream",
                    help="comma-separated: " + ", ".join(KINDS))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    env = environment()
    result = {**env, "benchmark": "host_step", "workload": {
        "num_seqs": args.num_seqs, "prompt_len": args.prompt_len, "steps": args.steps, "warmup": args.warmup,
        "repeats": args.repeats, "sampling": "greedy, ignore_eos, detokenize, no logprobs",
        "model": "stub runner (prepare_inputs + precomputed tokens); tiny qwen3 config and Qwen tokenizer",
        "async_scheduling": True, "timer": "time.perf_counter around the phases, median over repeats"},
        "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_model_dir(tmp, "qwen3", hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                        num_key_value_heads=1, head_dim=16))
        for workload in args.workloads.split(","):
            if workload not in KINDS:
                raise SystemExit(f"unknown workload {workload!r} ({', '.join(KINDS)})")
            out = run_workload(model_dir, args.num_seqs, args.prompt_len, args.steps, args.warmup, args.repeats,
                               workload)
            result["results"][workload] = out
            print(workload, json.dumps(out["ms_per_step"]))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{args.name or env['date'][:10] + '-host-step'}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
