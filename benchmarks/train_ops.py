"""Kernel launches and bytes touched per training step without a GPU: the speed diagnosis beside the memory one.

    python -m fxrewrite.benchmarks.train_ops --arm optimize --config qwen3-0.6b --layers 2,4 \
        [--no-gradient-checkpointing] [--out FILE]

The model is built and faked as in :mod:`fxrewrite.benchmarks.train_memory` (same config, bf16, batch, Liger's
patches or ``optimize``, the unpadded GPU path); one forward with labels and its backward run on fake tensors.
Counted per phase: every aten op that launches a device kernel (views and allocations left out, as in
:mod:`fxrewrite.benchmarks.count_launches`) and every Triton launch (Liger's included), each with the bytes of
its tensor arguments and results (read + written, views at their own size: an estimate of the memory traffic;
a GEMM's bytes are its operands'). Run at two layer counts, the difference over the layers is the per-layer cost
(the loss and embedding cancel out). Writes JSON (default
``benchmarks/results/<date>-<config>-train-ops-<arm>[-no-gc].json``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fxrewrite.benchmarks.out_paths import FILE_HELP, result_file
from fxrewrite.benchmarks.train_memory import (_build_meta, _fake_parameters, _masks_as_on_real_tensors,
                                               _triton_paths_without_launches)

__all__ = ["OpCounter", "count_step_ops"]


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


class OpCounter(TorchDispatchMode):
    """{"<phase>:aten:<op>" or "<phase>:triton:<kernel>": [launches, bytes]}; ``.item()`` reads 1."""

    def __init__(self):
        # here, not at the top: count_launches imports triton, which must come after the CLI sets TRITON_INTERPRET
        from fxrewrite.benchmarks.count_launches import NO_KERNEL

        super().__init__()
        self.skip = NO_KERNEL | {"device"}
        self.phase = "setup"
        self.counts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])

    def record(self, kind: str, name: str, nbytes: int) -> None:
        entry = self.counts[f"{self.phase}:{kind}:{name}"]
        entry[0] += 1
        entry[1] += nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1
        if func is torch.ops.aten.equal.default:  # Liger's "is grad_output 1.0?"
            return True
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in self.skip:
            # an ``out=`` tensor is the result: counted once
            self.record("aten", name, _nbytes((args, kwargs)) + (0 if "out" in (kwargs or {}) else _nbytes(out)))
        return out


@contextlib.contextmanager
def _counting_triton(counter: OpCounter):
    """Within (and inside `_triton_paths_without_launches`): every Triton launch is recorded, not run."""
    from triton.runtime import interpreter

    cls = interpreter.InterpretedFunction
    saved = cls.__dict__["run"]

    def run(self, *args, **kwargs):
        counter.record("triton", getattr(getattr(self, "fn", None), "__name__", "?"), _nbytes(args))

    cls.run = run
    try:
        yield
    finally:
        cls.run = saved


def count_step_ops(config: dict, arm: str, *, batch_size: int = 8, seq_len: int = 2048,
                   gradient_checkpointing: bool = True) -> dict[str, list[int]]:
    """{"<phase>:<kind>:<name>": [launches, bytes]} of one forward + backward of ``arm`` (stock, liger, optimize)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    counter = OpCounter()
    with _triton_paths_without_launches(), _masks_as_on_real_tensors(), _counting_triton(counter):
        model = _build_meta(config, arm, gradient_checkpointing, None)
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        _fake_parameters(model, fake_mode)
        with fake_mode:
            ids = torch.randint(0, model.config.vocab_size, (batch_size, seq_len))
            with counter:
                counter.phase = "forward"
                loss = model(input_ids=ids, labels=ids).loss
                counter.phase = "backward"
                loss.backward()
    return dict(counter.counts)


def per_layer(low: dict, high: dict, layers: int) -> dict[str, list[float]]:
    """(high - low) / layers for every key, zeros dropped."""
    out = {}
    for key in sorted(set(low) | set(high)):
        a, b = low.get(key, [0, 0]), high.get(key, [0, 0])
        diff = [(b[0] - a[0]) / layers, (b[1] - a[1]) / layers]
        if diff != [0, 0]:
            out[key] = diff
    return out


def main(argv=None) -> int:
    """CLI: per-layer launches and bytes of one arm (see the module docstring)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
    from fxrewrite.benchmarks.common import RESULTS_DIR, load_bench_config, write_result

    p = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.train_ops")
    p.add_argument("--arm", choices=["stock", "liger", "optimize"], required=True)
    p.add_argument("--config", default="qwen3-0.6b")
    p.add_argument("--layers", default="2,4", help="two decoder-layer counts; their difference gives per layer")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--out", type=result_file, default=None, help=FILE_HELP)
    args = p.parse_args(argv)
    bench = load_bench_config(args.config)
    low, high = (int(x) for x in args.layers.split(","))
    runs = {n: count_step_ops(dict(bench["config"], num_hidden_layers=n), args.arm, batch_size=args.batch_size,
                              seq_len=args.seq_len, gradient_checkpointing=not args.no_gradient_checkpointing)
            for n in (low, high)}
    layer = per_layer(runs[low], runs[high], high - low)
    for key, (n, nbytes) in sorted(layer.items(), key=lambda kv: -kv[1][1]):
        print(f"  {key:64s} {n:6.1f} launches {nbytes / 2**20:9.1f} MiB")
    totals = {ph: [sum(v[i] for k, v in layer.items() if k.startswith(ph)) for i in (0, 1)]
              for ph in ("forward", "backward")}
    for ph, (n, nbytes) in totals.items():
        print(f"per layer, {ph}: {n:.1f} launches, {nbytes / 2**20:,.1f} MiB touched")
    gc = not args.no_gradient_checkpointing
    result = {"arm": args.arm, "config": bench["name"], "layers": [low, high], "batch_size": args.batch_size,
              "seq_len": args.seq_len, "gradient_checkpointing": gc, "per_layer": layer, "per_layer_totals": totals,
              "runs": {str(n): r for n, r in runs.items()}}
    out = args.out or Path(RESULTS_DIR) / (f"{time.strftime('%Y-%m-%d')}-{bench['name']}-train-ops-{args.arm}"
                                           f"{'' if gc else '-no-gc'}.json")
    write_result(out, result)
    return 0


if __name__ == "__main__":
    from fxrewrite.benchmarks.tool_cli import run_cli

    raise SystemExit(run_cli(main))
