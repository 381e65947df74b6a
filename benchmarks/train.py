"""Training benchmark: stock transformers vs torch.compile vs Liger-Kernel vs fxrewrite.optimize, one process per arm.

    fxrewrite bench train --config qwen3-0.6b --arms stock,stock-compile,liger,optimize,optimize-compile \
        --batch-size 8 --seq-len 2048 --steps 8

Each arm runs in its own Python process (Liger's patches replace transformers functions module-wide and
must not leak into other arms): the model is built from the config with the same seed on the device
(same random weights in every arm), bf16, gradient checkpointing (``--no-gradient-checkpointing`` to
turn off), AdamW (fused on CUDA), ``model(input_ids, labels=input_ids)`` on the same random token ids.
Recorded per arm: tokens/s over the steps after ``--warmup`` (compile happens there), peak allocated
memory (torch.cuda.max_memory_allocated over the whole run: weights, optimizer state, activations; and per phase
of a step, ``phase_peak_bytes``),
the loss of every step; and per arm whether every step's loss is within ``--loss-rtol`` (1e-3) of
stock's. JSON + PNG go to benchmarks/results/train-<config>-<time>.{json,png}. Liger-Kernel comes from
the ``bench`` extra and is imported only inside its arm's process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fxrewrite.errors import UserInputError

ARMS = ("stock", "stock-compile", "liger", "optimize", "optimize-compile", "optimize-compile-inductor")
# optimize-compile (the default): our training kernels stay opaque custom ops in the compiled graph;
# optimize-compile-inductor: FXREWRITE_COMPILE_TRAIN_KERNELS=0, Inductor compiles their torch references instead


def _liger_patch(model_type: str, model) -> None:
    try:
        from liger_kernel.transformers import monkey_patch
    except ModuleNotFoundError as e:
        raise UserInputError(f"the liger arm needs liger-kernel ({e}): pip install 'fxrewrite[bench]' or "
                             "liger-kernel==0.8.5") from None

    apply = monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    apply(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True, model=model)


def enable_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing of every decoder layer, spelled for the installed transformers:
    ``activation_checkpointing_enable`` where it exists (``gradient_checkpointing_enable`` is its deprecated
    alias in newer 5.x), else ``gradient_checkpointing_enable`` (5.17)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _build(spec: dict, arm: str):
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**spec["config"])
    config.use_cache = False  # as Trainer / TRL train: no KV cache built (and kept alive) in the forward
    dtype = getattr(torch, spec["dtype"])
    torch.manual_seed(spec["seed"])
    with torch.device(spec["device"]):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.train()
    if spec["gradient_checkpointing"]:
        enable_checkpointing(model)
    if arm == "liger":
        _liger_patch(config.model_type, model)
    t0 = time.perf_counter()
    if arm.startswith("optimize"):
        from fxrewrite.compiler import optimize  # only this arm's process loads the library

        optimize(model)
    optimize_s = time.perf_counter() - t0
    runner = torch.compile(model) if "-compile" in arm else model
    return model, runner, optimize_s


def _compile_stats() -> dict:
    """What torch.compile did in this process: graph breaks, distinct graphs, frames, seconds in dynamo's
    compile (tracing + AOT + Inductor); the diagnosis behind a slow or failed compiled arm."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {"graph_breaks": sum(counters["graph_break"].values()),
            "graph_break_reasons": list(counters["graph_break"])[:5],
            "unique_graphs": counters["stats"].get("unique_graphs", 0), "frames": dict(counters["frames"]),
            "compile_s": round(sum(compilation_time_metrics.get("_compile.compile_inner", [])), 2)}


class PhasePeaks:
    """Peak allocated CUDA bytes per phase of a step (forward, backward, optimizer), the largest over the steps,
    and over the whole run: where a peak-memory difference between arms sits. ``mark`` costs no synchronisation
    (the allocator's counters); does nothing off CUDA."""

    def __init__(self, cuda: bool):
        self.cuda, self.phases, self.overall = cuda, {}, 0

    def mark(self, phase: str) -> None:
        """The peak since the previous mark belongs to ``phase``; the counter restarts."""
        import torch

        if self.cuda:
            peak = torch.cuda.max_memory_allocated()
            self.phases[phase] = max(self.phases.get(phase, 0), peak)
            self.overall = max(self.overall, peak)
            torch.cuda.reset_peak_memory_stats()


def worker(spec: dict, arm: str, progress: Path | None = None) -> dict:
    """Run one arm in this process; returns its record (raises on failure). With ``progress``, the record so
    far is written there after every step (a timed-out arm still shows how far it got)."""
    import torch

    if arm == "optimize-compile-inductor":
        os.environ["FXREWRITE_COMPILE_TRAIN_KERNELS"] = "0"  # read at trace time, in this arm's process only
    cuda = spec["device"].startswith("cuda")
    model, runner, optimize_s = _build(spec, arm)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], fused=cuda)
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    vocab = model.config.vocab_size
    losses, times, peaks = [], [], PhasePeaks(cuda)
    for step in range(spec["warmup"] + spec["steps"]):
        ids = torch.randint(0, vocab, (spec["batch_size"], spec["seq_len"]), generator=gen).to(spec["device"])
        if cuda:
            torch.cuda.synchronize()
        peaks.mark("setup" if step == 0 else "between steps")
        t0 = time.perf_counter()
        loss = runner(input_ids=ids, labels=ids).loss
        peaks.mark("forward")
        loss.backward()
        peaks.mark("backward")
        opt.step()
        opt.zero_grad(set_to_none=True)
        peaks.mark("optimizer")
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        if progress is not None:
            partial = {"arm": arm, "step_s": times, "losses": losses, "optimize_s": optimize_s}
            if "-compile" in arm:
                partial["compile"] = _compile_stats()
            progress.write_text(json.dumps(partial))
    timed = times[spec["warmup"]:]
    tokens = spec["batch_size"] * spec["seq_len"] * len(timed)
    return {"arm": arm, "tokens_per_s": tokens / sum(timed) if timed else None, "step_s": times,
            "peak_memory_bytes": peaks.overall if cuda else None, "phase_peak_bytes": peaks.phases or None,
            "losses": losses,
            "optimize_s": optimize_s, **({"compile": _compile_stats()} if "-compile" in arm else {})}


def _run_arm(spec: dict, arm: str, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        progress = Path(tmp, "progress.json")
        cmd = [sys.executable, "-m", "fxrewrite.benchmarks.train", "--worker", arm, str(spec_path), str(out_path),
               "--progress", str(progress)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=dict(os.environ))
        except subprocess.TimeoutExpired:
            done = json.loads(progress.read_text()) if progress.exists() else None
            return {"arm": arm, "error": f"timed out after {timeout_s:.0f} s", "progress": done}
        if proc.returncode != 0 or not out_path.exists():
            return {"arm": arm, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["failed"],
                    "stderr_tail": proc.stderr[-3000:]}
        return json.loads(out_path.read_text())


def agreement(records: list[dict], rtol: float) -> None:
    """Mark each record with max relative loss difference to stock and whether it is within rtol."""
    stock = next((r for r in records if r["arm"] == "stock" and "losses" in r), None)
    for r in records:
        if stock is None or "losses" not in r:
            continue
        diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], stock["losses"])]
        r["max_rel_loss_diff_vs_stock"] = max(diffs) if diffs else None
        r["losses_agree"] = bool(diffs) and max(diffs) <= rtol


def plot_train(result: dict, path: Path) -> Path | None:
    """PNG: tokens/s and peak memory per arm, and every arm's loss per step. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [r for r in result["arms"] if "losses" in r]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = [r["arm"] for r in ok]
    axes[0].bar(names, [r["tokens_per_s"] or 0 for r in ok])
    axes[0].set_ylabel("tokens/s")
    axes[1].bar(names, [(r["peak_memory_bytes"] or 0) / 2**30 for r in ok])
    axes[1].set_ylabel("peak memory (GiB)")
    for r in ok:
        axes[2].plot(r["losses"], label=r["arm"])
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("loss")
    axes[2].legend()
    for ax in axes[:2]:
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"train {result['config']} batch {result['batch_size']}x{result['seq_len']}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def parse_arm_timeouts(text: str) -> dict[str, float]:
    """``"60,stock-compile=150"`` -> {"*": 60.0, "stock-compile": 150.0} (``*``: every other arm; default 900).
    ValueError naming the entry on a bad number or an unknown arm."""
    out = {"*": 900.0}
    for part in (p.strip() for p in str(text).split(",") if p.strip()):
        arm, _, value = part.rpartition("=")
        if arm and arm not in ARMS:
            raise UserInputError(f"--arm-timeout: unknown arm {arm!r} in {part!r}; expected one of {list(ARMS)}")
        try:
            seconds = float(value)
        except ValueError:
            raise UserInputError(f"--arm-timeout: {part!r} is not SECONDS or ARM=SECONDS") from None
        if not 0 < seconds < float("inf"):  # nan too
            raise UserInputError(f"--arm-timeout: {part!r}: expected a finite number of seconds above 0")
        out[arm or "*"] = seconds
    return out


def run_train_bench(config: str, arms: list[str], *, steps: int = 8, warmup: int = 2, batch_size: int = 8,
                    seq_len: int = 2048, gradient_checkpointing: bool = True, dtype: str = "bfloat16",
                    device: str | None = None, lr: float = 1e-5, seed: int = 0, loss_rtol: float = 1e-3,
                    arm_timeout_s: float | dict = 900.0, out_dir: Path | None = None, notes=()) -> dict:
    """Run every arm in its own process; write and return the result (JSON + PNG paths under "files").
    ``arm_timeout_s``: seconds per arm, or {arm: seconds, "*": the others' seconds} (:func:`parse_arm_timeouts`)."""
    import torch

    from fxrewrite.benchmarks.common import RESULTS_DIR, environment, load_bench_config

    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:  # no arm at all wrote an empty table and exited 0
        what = f"unknown train arm(s) {unknown}" if unknown else "no train arm given"
        raise UserInputError(f"{what}; expected some of {list(ARMS)}")
    bench = load_bench_config(config)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec = {"config": bench["config"], "dtype": dtype, "device": device, "seed": seed, "lr": lr, "steps": steps,
            "warmup": warmup, "batch_size": batch_size, "seq_len": seq_len,
            "gradient_checkpointing": gradient_checkpointing}
    limits = arm_timeout_s if isinstance(arm_timeout_s, dict) else {"*": float(arm_timeout_s)}
    records = [_run_arm(spec, arm, limits.get(arm, limits.get("*", 900.0))) for arm in arms]
    agreement(records, loss_rtol)
    stamp = time.strftime("%Y-%m-%d")
    result = {"kind": "train", "config": bench["name"], **{k: v for k, v in spec.items() if k != "config"},
              "loss_rtol": loss_rtol, "arms": records, "environment": environment(), "notes": list(notes)}
    out = Path(out_dir or RESULTS_DIR)
    out.mkdir(parents=True, exist_ok=True)
    # "<date>-<config>-train[-no-gc]": with_suffix would cut config names such as "qwen3-0.6b" at the dot.
    base = f"{stamp}-{bench['name']}-train" + ("" if spec["gradient_checkpointing"] else "-no-gc")
    json_path, png_path = out / f"{base}.json", out / f"{base}.png"
    files = [str(json_path)]
    png = plot_train(result, png_path)
    if png is not None:
        files.append(str(png))
    result["files"] = files
    json_path.write_text(json.dumps(result, indent=1))
    return result


def format_train_table(result: dict) -> str:
    lines = ["| arm | tokens/s | peak memory (GiB) | max rel. loss diff vs stock | agree |", "|---|---:|---:|---:|---|"]
    for r in result["arms"]:
        if "error" in r:
            lines.append(f"| {r['arm']} | failed: {r['error']} | | | |")
            continue
        mem = f"{r['peak_memory_bytes'] / 2**30:.2f}" if r.get("peak_memory_bytes") else "-"
        diff = r.get("max_rel_loss_diff_vs_stock")
        lines.append(f"| {r['arm']} | {r['tokens_per_s']:,.0f} | {mem} | "
                     f"{'-' if diff is None else f'{diff:.2e}'} | {r.get('losses_agree', '-')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Worker entry point: ``--worker ARM SPEC.json OUT.json`` (used by run_train_bench)."""
    parser = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.train")
    parser.add_argument("--worker", nargs=3, metavar=("ARM", "SPEC", "OUT"), required=True)
    parser.add_argument("--progress", type=Path, default=None, help="write the record so far here after each step")
    args = parser.parse_args(argv)
    arm, spec_path, out_path = args.worker
    record = worker(json.loads(Path(spec_path).read_text()), arm, args.progress)
    Path(out_path).write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    from fxrewrite.benchmarks.tool_cli import run_cli

    raise SystemExit(run_cli(main))
