"""Wall time of ``fxrewrite.optimize`` itself on a real-size model (target: Qwen3-4B under 5 s).

    python -m fxrewrite.benchmarks.optimize_time --config qwen3-4b [--repeats 1] [--device cuda] [--threads 1]

The model is built as the training benchmark builds it (``AutoModelForCausalLM.from_config``, bf16, train
mode, gradient checkpointing, ``use_cache=False``), but on the meta device and then materialised with
``to_empty`` and a normal(0, 0.02) fill per tensor, which needs one copy of the weights in memory (Qwen3-4B:
8 GB) instead of transformers' float32 init. The timed call is the real ``optimize`` on that materialised
model (tracing on meta tensors, the source rewrite, building the fused layers and copying their weights).
Each repeat builds a fresh model. Records every repeat's wall time and this process's CPU time (on a shared
machine the wall time includes waiting for a core), the device, the CPU and the fusion report's head; JSON to ``benchmarks/results/<date>-<config>-optimize-time.json``.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from fxrewrite.benchmarks.out_paths import FILE_HELP, result_file

__all__ = ["build_materialised", "time_optimize"]


def build_materialised(config: dict, device: str = "cpu", dtype: torch.dtype = torch.bfloat16):
    """The model of ``config`` (a transformers config dict), random weights (std 0.02) on ``device``."""
    import transformers

    from fxrewrite.benchmarks.train import enable_checkpointing

    cfg = transformers.AutoConfig.for_model(**config)
    cfg.use_cache = False
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
        for module in model.modules():  # rotary inv_freq: as the module's own __init__ computes it
            if hasattr(module, "inv_freq") and hasattr(module, "compute_default_rope_parameters"):
                fn = module.compute_default_rope_parameters
                if module.rope_type != "default":
                    fn = ROPE_INIT_FUNCTIONS[module.rope_type]
                inv, _ = fn(module.config)
                module.inv_freq.copy_(inv)
                module.original_inv_freq.copy_(inv)
    model.tie_weights()
    model.train()
    enable_checkpointing(model)
    return model


def time_optimize(config: dict, repeats: int = 1, device: str = "cpu") -> dict:
    """{"seconds": wall [per repeat], "cpu_seconds": this process's CPU time (all threads) [per repeat],
    "report_head": the fusion report's first lines} for ``optimize`` on fresh models."""
    from fxrewrite.compiler import explain, optimize

    seconds, cpu_seconds, summary = [], [], None
    for _ in range(repeats):
        model = build_materialised(config, device)
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        optimize(model)
        _sync(device)  # the fused weights' copies are asynchronous on a GPU: count them
        seconds.append(time.perf_counter() - t0)
        cpu_seconds.append(time.process_time() - c0)
        summary = str(explain(model)).splitlines()[:12]
        del model
        gc.collect()
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "report_head": summary}


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    """CLI: see the module docstring."""
    from fxrewrite.benchmarks.common import RESULTS_DIR, environment, load_bench_config, write_result
    from fxrewrite.benchmarks.tool_cli import count_argument, device_argument

    p = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.optimize_time")
    p.add_argument("--config", default="qwen3-4b")
    p.add_argument("--repeats", type=count_argument, default=1)
    p.add_argument("--device", type=device_argument, default="cpu")
    p.add_argument("--threads", type=count_argument, default=None,
                   help="torch intra-op threads (default: torch's); on a busy shared CPU, 1 avoids threads waiting "
                        "for a core inside every weight copy")
    p.add_argument("--note", default="")
    p.add_argument("--out", type=result_file, default=None, help=FILE_HELP)
    args = p.parse_args(argv)
    bench = load_bench_config(args.config)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = time_optimize(bench["config"], args.repeats, args.device)
    result.update(config=bench["name"], device=args.device, torch_threads=torch.get_num_threads(),
                  environment=environment(), note=args.note)
    print(f"optimize on {bench['name']} ({args.device}): " + ", ".join(
        f"{s:.2f} s wall, {c:.2f} s CPU" for s, c in zip(result["seconds"], result["cpu_seconds"])))
    out = args.out or Path(RESULTS_DIR) / f"{time.strftime('%Y-%m-%d')}-{bench['name']}-optimize-time.json"
    write_result(out, result)
    return 0


if __name__ == "__main__":
    from fxrewrite.benchmarks.tool_cli import run_cli

    raise SystemExit(run_cli(main))
