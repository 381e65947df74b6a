"""Kernel launches per decode step, counted on the host (no GPU needed): a batch-1 decode step's model
forward run eagerly, with every Triton kernel started through `fxrewrite.kernels.triton_utils.launch`
counted by name and every other aten op that would launch a device kernel counted by op (views and
other metadata-only ops are left out; a cuBLAS GEMM counts once, though cuBLAS may add a split-K reduce).

On a CPU set ``TRITON_INTERPRET=1`` before anything imports triton and ``FXREWRITE_TRITON=1`` so the
Triton kernels run (in the interpreter) instead of their torch references, whose many small ops would
be counted instead. ``python -m fxrewrite.benchmarks.count_launches --out DIR`` writes a tiny Qwen3's
native arm, with the fused KV write and without, to ``<date>-decode-launches.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxrewrite.benchmarks.out_paths import FOLDER_HELP, results_folder
from fxrewrite.errors import UserInputError
from fxrewrite.kernels.triton_utils import listen_launches

NO_KERNEL = frozenset({
    "view", "_unsafe_view", "reshape", "split", "split_with_sizes", "slice", "select", "t", "transpose",
    "permute", "expand", "alias", "detach", "as_strided", "unsqueeze", "squeeze", "empty", "empty_like",
    "empty_strided", "unbind", "chunk", "narrow", "lift_fresh", "_to_copy_noop", "size", "stride",
    "is_same_size", "_local_scalar_dense", "item", "contiguous", "flatten", "promote_types",
})
"""aten ops that launch no device kernel (views, metadata, allocation)."""


class LaunchCounter(TorchDispatchMode):
    """Counts `triton:<kernel>` launches and `aten:<op>` kernels; ops inside a Triton launch (the
    interpreter's own tensor copies) are not counted."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self._depth == 0 and name not in NO_KERNEL:
            self.counts[f"aten:{name}"] += 1
        return func(*args, **(kwargs or {}))

    def enter_launch(self, name: str) -> None:
        if self._depth == 0:
            self.counts[f"triton:{name}"] += 1
        self._depth += 1

    def exit_launch(self, name: str) -> None:
        self._depth -= 1


def decode_step_launches(llm, prompt: list[int] | None = None) -> Counter:
    """Launches of the model forward of one batch-1 decode step of `llm` (an `LLM`): the prompt is
    prefilled by one engine step, then the next step's forward is counted. CUDA graphs are bypassed
    (the forward runs eagerly), so the count is what a graph would hold."""
    from fxrewrite.runtime.engine.sampling_params import SamplingParams

    engine = llm.llm_engine
    runner = engine.model_runner
    engine.add_request("launch-count", prompt or list(range(5, 21)), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # prefill
    counter = LaunchCounter()
    model = runner.model
    graphs, runner.graph_runner = runner.graph_runner, None
    def start(*_):
        counter.__enter__()

    def stop(*_):
        counter.__exit__(None, None, None)

    handles = [model.register_forward_pre_hook(start), model.register_forward_hook(stop)]
    try:
        with listen_launches(counter):
            engine.step()
    finally:
        for h in handles:
            h.remove()
        runner.graph_runner = graphs
    while engine.has_unfinished_requests():
        engine.step()
    return counter.counts


def summary(counts: Counter, num_layers: int) -> dict:
    """Totals and the per-kernel counts (sorted), plus launches per decoder layer (total / layers)."""
    total = sum(counts.values())
    return {"total": total, "per_layer": round(total / num_layers, 2), "kernels": dict(sorted(counts.items()))}


def main(argv: list[str] | None = None) -> dict:
    """CLI: count a tiny Qwen3's batch-1 decode launches, native (fused KV write) and native unfused
    (the path torch.compile takes, and the one before the fusion); print and write JSON."""
    from fxrewrite.runtime.model_files.demo import build_model_dir

    parser = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.count_launches",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=results_folder, default=None, help=FOLDER_HELP)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":  # else the torch references' many small ops are what is counted
        raise UserInputError("count_launches counts the Triton kernels run in the interpreter on the CPU: set "
                             "TRITON_INTERPRET=1 (before anything imports triton)")
    os.environ.setdefault("FXREWRITE_TRITON", "1")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # the tiny model lives for this run only
        return _count(build_model_dir(Path(tmp) / "qwen3", "qwen3", num_hidden_layers=args.layers), args)


def _count(folder: Path, args) -> dict:
    from datetime import date

    from fxrewrite.benchmarks.common import environment
    from fxrewrite.runtime.llm import LLM
    from fxrewrite.runtime.models.llama import LlamaAttention
    from fxrewrite.runtime.models.qwen3 import Qwen3Attention

    result = {"date": date.today().isoformat(), "environment": environment(), "model": f"tiny qwen3, {args.layers} layers",
              "device": "cpu (Triton interpreter)", "arms": {}}
    # The after arm is left out: its launches depend on what the rewrite matched with this machine's
    # transformers; `fxrewrite.benchmarks.profile_decode` counts a GPU step's kernels for every arm.
    arms = (("native", "native", None), ("native-unfused", "native", LlamaAttention.forward))
    for name, impl, forward in arms:
        llm = LLM(str(folder), model_impl=impl, dtype="float32", kv_cache_memory_bytes=1 << 22, max_model_len=256)
        previous = Qwen3Attention.forward
        if forward is not None:  # the unfused path: norm-rope kernel, then the attention's cache write
            Qwen3Attention.forward = forward
        try:
            result["arms"][name] = summary(decode_step_launches(llm), args.layers)
        finally:
            Qwen3Attention.forward = previous
    print(json.dumps(result, indent=1))
    if args.out is not None:
        (args.out / f"{date.today()}-decode-launches.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    from fxrewrite.benchmarks.tool_cli import run_cli

    torch.set_num_threads(1)
    raise SystemExit(run_cli(lambda: main() and 0))  # main returns the result dict, not a status
