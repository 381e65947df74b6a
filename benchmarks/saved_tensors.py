"""What a training forward keeps for the backward, per autograd node type: the memory diagnosis behind the
training benchmark's peak-memory column.

    python -m fxrewrite.benchmarks.saved_tensors --arm optimize --config qwen3-0.6b --layers 1 \
        --batch-size 8 --seq-len 2048

One arm per process (``stock``, ``liger``, ``optimize``: Liger patches transformers module-wide). The model
is built as in :mod:`fxrewrite.benchmarks.train` (same seed, dtype, device) without activation
checkpointing, so every tensor a layer saves is visible; one forward with labels, then the autograd graph
is walked from the loss: each node's saved tensors (``_saved_*`` of built-in nodes, ``saved_tensors`` of
custom functions) are counted once per storage, by the bytes of that storage (a saved view keeps its
whole base alive), attributed to the first node seen holding it. Parameters are left out. Prints the
table and writes JSON to ``--out`` (default ``benchmarks/results/<date>-<config>-saved-<arm>.json``).
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import torch

from fxrewrite.benchmarks.out_paths import FILE_HELP, result_file
from fxrewrite.benchmarks.train import _build

__all__ = ["saved_tensor_bytes"]


def _node_tensors(fn) -> list[torch.Tensor]:
    found = []
    if not type(fn).__name__.endswith("Backward0") and hasattr(fn, "saved_tensors"):
        try:
            found += [t for t in fn.saved_tensors if isinstance(t, torch.Tensor)]
        except RuntimeError:  # freed or not a custom function
            pass
    for name in dir(fn):
        if name.startswith("_saved_"):
            try:
                value = getattr(fn, name)
            except Exception:  # noqa: BLE001 - some saved fields cannot be read back
                continue
            values = value if isinstance(value, (tuple, list)) else (value,)
            found += [v for v in values if isinstance(v, torch.Tensor)]
    return found


def saved_tensor_bytes(loss: torch.Tensor, parameters=()) -> dict[str, int]:
    """{autograd node type: bytes of the distinct storages its saved tensors hold}, largest first; storages of
    ``parameters`` (and of leaves that require grad) are left out."""
    seen = {(p.untyped_storage().device.type, p.untyped_storage().data_ptr()) for p in parameters}
    totals, stack, visited = collections.Counter(), [loss.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in visited:
            continue
        visited.add(fn)
        stack.extend(f for f, _ in fn.next_functions)
        for t in _node_tensors(fn):
            storage = t.untyped_storage()
            key = (storage.device.type, storage.data_ptr())
            if key in seen or (t.is_leaf and t.requires_grad):
                continue
            seen.add(key)
            totals[type(fn).__name__] += storage.nbytes()
    return dict(totals.most_common())


def main(argv=None) -> int:
    """CLI: one arm's saved-tensor bytes per node type (see the module docstring)."""
    from fxrewrite.benchmarks.common import RESULTS_DIR, load_bench_config, write_result
    from fxrewrite.benchmarks.tool_cli import count_argument, device_argument

    p = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.saved_tensors")
    p.add_argument("--arm", choices=["stock", "liger", "optimize"], required=True)
    p.add_argument("--config", default="qwen3-0.6b")
    p.add_argument("--layers", type=count_argument, default=1, help="decoder layers (saved bytes grow linearly)")
    p.add_argument("--batch-size", type=count_argument, default=8)
    p.add_argument("--seq-len", type=count_argument, default=2048)
    p.add_argument("--device", type=device_argument, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--out", type=result_file, default=None, help=FILE_HELP)
    args = p.parse_args(argv)
    bench = load_bench_config(args.config)
    spec = {"config": dict(bench["config"], num_hidden_layers=args.layers), "dtype": args.dtype,
            "device": args.device, "seed": 0, "gradient_checkpointing": False}
    model, runner, _ = _build(spec, args.arm)
    ids = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len),
                        generator=torch.Generator().manual_seed(1)).to(args.device)
    totals = saved_tensor_bytes(runner(input_ids=ids, labels=ids).loss, model.parameters())
    for name, nbytes in totals.items():
        print(f"{name:60s} {nbytes / 2**20:10.1f} MiB")
    print(f"{'total':60s} {sum(totals.values()) / 2**20:10.1f} MiB")
    out = args.out or Path(RESULTS_DIR) / f"{time.strftime('%Y-%m-%d')}-{bench['name']}-saved-{args.arm}.json"
    write_result(out, {"arm": args.arm, "config": bench["name"], "layers": args.layers,  # with its environment
                       "batch_size": args.batch_size, "seq_len": args.seq_len, "device": args.device,
                       "dtype": args.dtype, "saved_bytes": totals})
    return 0


if __name__ == "__main__":
    from fxrewrite.benchmarks.tool_cli import run_cli

    raise SystemExit(run_cli(main))
