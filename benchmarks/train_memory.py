"""Peak memory of training steps without a GPU: the real model config at full batch, on fake tensors.

    python -m fxrewrite.benchmarks.train_memory --arm optimize --config qwen3-0.6b --layers 28 \
        --batch-size 8 --seq-len 2048 [--no-gradient-checkpointing] [--chunk-size 512]

The model is built on the meta device as in :mod:`fxrewrite.benchmarks.train` (same config, bf16,
checkpointing, Liger's patches or ``optimize``), its parameters become ``FakeTensor`` s (shapes, dtypes and
storages, no data), and two steps (forward with labels, backward, fused AdamW, ``zero_grad``) run under a
dispatch mode that counts the bytes of every live storage: a storage is counted when an op first returns
it and uncounted when it dies (weak reference), so views and in-place ops are free, as in the CUDA
caching allocator's "allocated" figure (without its rounding to 512 bytes). Triton launches are no-ops
(the kernels' outputs are allocated by torch, which is all that is measured), ``.item()`` reads 1 and
``torch.equal`` True.
Reports the peak of each step and of each phase, where it happened, and what was live then, grouped by
the op that made each storage (``forward:<module path>:<op>``, ``backward:<op>``, ``optimizer:<op>``;
``--lines``: the source line that called the op).

Transformers treats a FakeTensor as tracing and then builds a [B, 1, S, S] mask, which turns off SDPA's
grouped-query path (k and v are repeated by copies, the unrepeated v dies): the simulation undoes that
(:func:`_masks_as_on_real_tensors`), so that, as in an eager GPU run without padding, there is no mask and
SDPA gets ``enable_gqa`` and saves k and v themselves. ``--padding-mask`` keeps transformers' fake-tensor
path instead: a materialised 4D mask and repeated k/v, as in a batch with padding.

Caveats, equal for all arms: CPU SDPA (flash-style; saves the output and float32 log-sum-exp like CUDA's
flash kernel) and no allocator rounding or fragmentation; the GPU figure adds the CUDA context's workspace.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fxrewrite.benchmarks.out_paths import FILE_HELP, result_file

__all__ = ["LiveBytes", "simulate_step_memory"]


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live storages that ops return; keeps the peak and what was live at it."""

    def __init__(self, lines: bool = False):
        super().__init__()
        self.lines = lines  # label by the calling source line instead of the module path
        self.live, self.peak, self.phase, self.module = 0, 0, "setup", ""
        self.sizes: dict[int, tuple[int, str]] = {}
        self.at_peak: dict = {}
        self.phase_peaks: dict[str, int] = {}
        self.phase_at_peak: dict[str, tuple] = {}

    def add(self, t: torch.Tensor, label: str) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.sizes:
            return
        self.sizes[key] = (storage.nbytes(), label)
        self.live += storage.nbytes()
        weakref.finalize(storage, self._free, key)
        if self.live > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = self.live
            self.phase_at_peak[self.phase] = (label, list(self.sizes.values()))
        if self.live > self.peak:
            self.peak = self.live
            self.at_peak = {"phase": self.phase, "op": label, "sizes": list(self.sizes.values())}

    def relabel(self, t: torch.Tensor, label: str) -> None:
        """Name a live storage by what it is (a parameter's gradient) instead of the op that made it."""
        key = t.untyped_storage()._cdata
        if key in self.sizes:
            self.sizes[key] = (self.sizes[key][0], label)

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (per training step)."""
        self.peak, self.at_peak = self.live, {"phase": self.phase, "op": "", "sizes": list(self.sizes.values())}
        self.phase_peaks, self.phase_at_peak = {}, {}

    def _free(self, key: int) -> None:
        nbytes, _ = self.sizes.pop(key)
        self.live -= nbytes

    def breakdown_at_peak(self, phase: str | None = None) -> dict[str, int]:
        """{creating op label: bytes live at the step's peak (or ``phase``'s)}, largest first."""
        totals = collections.Counter()
        for nbytes, label in self.phase_at_peak[phase][1] if phase else self.at_peak["sizes"]:
            totals[label] += nbytes
        return dict(totals.most_common())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:  # .item() on data that does not exist
            return 1
        if func is torch.ops.aten.equal.default:  # Liger's "is grad_output 1.0?": it is, after loss.backward()
            return True
        out = func(*args, **(kwargs or {}))
        # module paths only in the forward: the checkpoint recompute stops early, skipping forward hooks
        where = f"{self.phase}:{self.module}:" if self.module and self.phase == "forward" else f"{self.phase}:"
        if self.lines:
            where = f"{self.phase}:{_caller()}:"
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.add(t, where + func.overloadpacket.__name__)
        return out


def _caller() -> str:
    """file:line of the innermost frame outside torch and this file (autograd's own backward ops: "autograd")."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/" not in name and not name.endswith("train_memory.py") and "/contextlib" not in name:
            return f"{'/'.join(name.split('/')[-2:])}:{frame.f_lineno}"
        frame = frame.f_back
    return "autograd"


@contextlib.contextmanager
def _triton_paths_without_launches():
    """Within: the Triton code paths are taken on a CPU (``FXREWRITE_TRITON=1``; their torch allocations are
    what is measured) and every Triton launch is a no-op; both undone on exit. Needs triton imported under
    ``TRITON_INTERPRET=1`` set before anything imports triton (the test suite sets it; the command line needs it
    in the environment: the package imports triton before ``main`` runs); UserInputError otherwise."""
    from fxrewrite.kernels.triton_utils import interpreter_ready
    from triton.runtime import interpreter, jit

    if not interpreter_ready():
        from fxrewrite.errors import UserInputError

        raise UserInputError("this counts the Triton paths on a CPU, so triton must be imported under "
                             "TRITON_INTERPRET=1: run it as `TRITON_INTERPRET=1 python -m fxrewrite.benchmarks...`")
    noop = lambda *a, **k: None  # noqa: E731
    saved = [(cls, name, cls.__dict__[name]) for cls in (interpreter.InterpretedFunction, jit.JITFunction)
             for name in ("__getitem__", "run") if name in cls.__dict__]
    env = os.environ.get("FXREWRITE_TRITON")
    os.environ["FXREWRITE_TRITON"] = "1"
    for cls, name, _ in saved:
        setattr(cls, name, (lambda self, grid: noop) if name == "__getitem__" else noop)
    try:
        yield
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)
        if env is None:
            os.environ.pop("FXREWRITE_TRITON", None)
        else:
            os.environ["FXREWRITE_TRITON"] = env


@contextlib.contextmanager
def _masks_as_on_real_tensors():
    """Within: transformers' mask code does not count a FakeTensor as tracing (its mask skip and packed-sequence
    check then decide as on real tensors; ``.all()`` of fake data reads True)."""
    from transformers import masking_utils

    real = masking_utils.is_tracing
    masking_utils.is_tracing = lambda tensor=None: real(None)
    try:
        yield
    finally:
        masking_utils.is_tracing = real


def _liger_flce_cuda_allocations(_input, weight, target, ce_weight=None, bias=None, ignore_index=-100, **_):
    """The allocations of Liger-Kernel 0.8.5's fused linear cross-entropy forward on an sm80+ GPU (bf16, no
    bias, mean): d/dinput and d/dweight zeroed in the input's dtype, float32 per-row losses, one preallocated
    [chunk, V] logits buffer (chunk: the power of two above BT / ceil(V / H), at most BT) that each chunk's
    ``mm(out=)`` fills and whose gradient ``mm(out=)`` / ``addmm(out=grad_weight)`` consume. Our model of
    its CUDA branch (``_can_use_mm_out`` and the low-precision ``addmm`` accumulation); on a CPU Liger takes
    its fallback, a [V, H] product and its float32 copy per chunk (890 MiB for Qwen3-0.6B), which the GPU
    never allocates. Same 7-tuple as Liger's function (values are fake)."""
    rows, hidden = _input.shape
    vocab = weight.shape[0]
    chunk = min(1 << max(0, (-(-rows // -(-vocab // hidden)) - 1).bit_length()), rows)
    grad_input, grad_weight = torch.zeros_like(_input), torch.zeros_like(weight)
    losses = torch.zeros(rows, dtype=torch.float32, device=_input.device)
    _ = (target != ignore_index).sum()  # its count of non-ignored rows
    logits = torch.empty((chunk, vocab), dtype=_input.dtype, device=_input.device)
    for s in range(0, rows, chunk):
        z = logits[:min(chunk, rows - s)]
        torch.mm(_input[s:s + chunk], weight.t(), out=z)
        torch.mm(z, weight, out=grad_input[s:s + chunk])
        torch.addmm(grad_weight, z.t(), _input[s:s + chunk], out=grad_weight)
    del logits, z
    return losses.sum(), None, None, None, grad_input, grad_weight, None


H200_SMS = 132  # streaming multiprocessors of the GPU the training benchmark runs on


def _dweight_as_on_cuda(dweight, total, dy, a) -> None:
    """gated_mlp_down's d/dweight as CUDA allocates it: ``mm(out=)`` / ``addmm(out_dtype=float32, out=total)`` make
    nothing new (the CPU fallback's float32 copies of dy and a exist only off the GPU)."""
    if total is None:
        torch.mm(dy.t(), a, out=dweight)


@contextlib.contextmanager
def _gpu_program_counts():
    """Within: our RMSNorm backward sizes its float32 partial d/dweight rows as on an H200 (4 programs per
    SM) instead of the interpreter's 4 programs; act-and-mul + down_proj accumulates d/dweight without copies,
    as on CUDA (:func:`_dweight_as_on_cuda`); the deferred LM-head gradient takes the fake parameters."""
    from fxrewrite.kernels import gated_mlp_down, rms_norm_backward

    from fxrewrite.layers import deferred_head_grad

    real = rms_norm_backward._num_programs, gated_mlp_down._accumulate_dweight, deferred_head_grad.plain_parameter
    rms_norm_backward._num_programs = lambda rows, device: min(rows, 4 * H200_SMS)
    gated_mlp_down._accumulate_dweight = _dweight_as_on_cuda
    deferred_head_grad.plain_parameter = lambda weight: isinstance(weight, torch.nn.Parameter)  # fake ones too
    try:
        yield
    finally:
        rms_norm_backward._num_programs, gated_mlp_down._accumulate_dweight, deferred_head_grad.plain_parameter = real


@contextlib.contextmanager
def _liger_cuda_path(arm: str):
    """Within (the liger arm): Liger's fused linear cross-entropy forward allocates as on the GPU
    (:func:`_liger_flce_cuda_allocations`) instead of taking its CPU fallback."""
    if arm != "liger":
        yield
        return
    from liger_kernel.ops import fused_linear_cross_entropy as flce

    real = flce.fused_linear_cross_entropy_forward
    flce.fused_linear_cross_entropy_forward = _liger_flce_cuda_allocations
    try:
        yield
    finally:
        flce.fused_linear_cross_entropy_forward = real


def _fake_parameters(model: torch.nn.Module, fake_mode) -> None:
    """Swap every parameter and buffer for a fake CPU tensor of its shape and dtype; tied ones stay tied."""
    made = {}

    def fake(t, param: bool):
        if id(t) not in made:
            with fake_mode:
                f = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            made[id(t)] = torch.nn.Parameter(f, requires_grad=t.requires_grad) if param else f
        return made[id(t)]

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = fake(p, True)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = fake(b, False)


def _build_meta(config: dict, arm: str, gradient_checkpointing: bool, chunk_size: int | None):
    import transformers

    from fxrewrite.benchmarks.train import _liger_patch, enable_checkpointing

    cfg = transformers.AutoConfig.for_model(**config)
    cfg.use_cache = False  # as the train benchmark (and Trainer / TRL) run
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.train()
    if gradient_checkpointing:
        enable_checkpointing(model)
    if arm == "liger":
        _liger_patch(cfg.model_type, model)
    elif arm == "optimize":
        from fxrewrite.compiler import optimize

        optimize(model)
        for module in model.modules():
            if type(module).__name__ == "LMHeadCrossEntropy":
                module.chunk_size = chunk_size or module.chunk_size
                # its check wants a plain nn.Parameter head weight; fake ones are FakeTensor-typed parameters
                module.fuses = lambda model, labels, *a, **k: labels is not None and model.training
                module.checkpointing = gradient_checkpointing
    return model


def _track_modules(model, tracker: LiveBytes) -> list:
    """Forward hooks that keep ``tracker.module`` at the running module's path (layer numbers as ``*``)."""
    import re

    names = {id(m): re.sub(r"\.\d+(\.|$)", r".*\1", n) for n, m in model.named_modules()}
    stack = []

    def pre(module, args):
        stack.append(tracker.module)
        tracker.module = names.get(id(module), tracker.module)

    def post(module, args, out):
        tracker.module = stack.pop() if stack else ""

    return [torch.nn.modules.module.register_module_forward_pre_hook(pre),
            torch.nn.modules.module.register_module_forward_hook(post)]


def simulate_step_memory(config: dict, arm: str, *, batch_size: int = 8, seq_len: int = 2048,
                         gradient_checkpointing: bool = True, steps: int = 2, chunk_size: int | None = None,
                         lines: bool = False, padding_mask: bool = False) -> dict:
    """Peak live bytes of each of ``steps`` training steps of ``arm`` (stock, liger, optimize) with the model
    built from ``config`` (a transformers config dict) in bf16: {"steps": [{"peak_bytes", "phase", "op",
    "at_peak": {label: bytes}}], "parameter_bytes"}. Fake tensors: nothing is computed. ``padding_mask``: the
    materialised-mask path of a padded batch (4D mask, k/v repeated by copies) instead of the unpadded one."""
    masks = contextlib.nullcontext() if padding_mask else _masks_as_on_real_tensors()
    with _triton_paths_without_launches(), masks, _liger_cuda_path(arm), _gpu_program_counts():
        return _simulate(config, arm, batch_size, seq_len, gradient_checkpointing, steps, chunk_size, lines)


def _simulate(config, arm, batch_size, seq_len, gradient_checkpointing, steps, chunk_size, lines) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = _build_meta(config, arm, gradient_checkpointing, chunk_size)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    _fake_parameters(model, fake_mode)
    tracker = LiveBytes(lines)
    hooks = _track_modules(model, tracker)
    params = [p for p in model.parameters() if p.requires_grad]
    hooks += [p.register_post_accumulate_grad_hook(lambda p: tracker.relabel(p.grad, "grads")) for p in params]
    records = []
    try:
        with fake_mode, tracker:
            for t in list(model.parameters()) + list(model.buffers()):
                tracker.add(t, "parameters")
            opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
            for _ in range(steps):
                tracker.phase = "inputs"
                ids = torch.randint(0, model.config.vocab_size, (batch_size, seq_len))
                tracker.reset_peak()
                tracker.phase = "forward"
                loss = model(input_ids=ids, labels=ids).loss
                tracker.phase = "backward"
                loss.backward()
                tracker.phase = "optimizer"
                opt.step()
                opt.zero_grad(set_to_none=True)
                del loss
                records.append({"peak_bytes": tracker.peak, "phase": tracker.at_peak["phase"],
                                "op": tracker.at_peak["op"], "phase_peaks": dict(tracker.phase_peaks),
                                "at_peak": tracker.breakdown_at_peak(),
                                "at_phase_peak": {k: {"op": v[0], "live": tracker.breakdown_at_peak(k)}
                                                  for k, v in tracker.phase_at_peak.items()}})
    finally:
        for h in hooks:
            h.remove()
    return {"steps": records, "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def main(argv=None) -> int:
    """CLI: one arm's simulated peak memory (see the module docstring)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import: kernels become interpretable
    from fxrewrite.benchmarks.common import RESULTS_DIR, load_bench_config, write_result

    p = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.train_memory")
    p.add_argument("--arm", choices=["stock", "liger", "optimize"], required=True)
    p.add_argument("--config", default="qwen3-0.6b")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the config's)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--chunk-size", type=int, default=None, help="fused linear cross-entropy rows per chunk")
    p.add_argument("--padding-mask", action="store_true", help="the masked path of a padded batch")
    p.add_argument("--lines", action="store_true", help="label storages by the source line that made them")
    p.add_argument("--top", type=int, default=14, help="labels to print of what is live at the peak")
    p.add_argument("--note", default="", help="recorded in the JSON")
    p.add_argument("--out", type=result_file, default=None, help=FILE_HELP)
    args = p.parse_args(argv)
    bench = load_bench_config(args.config)
    config = dict(bench["config"], **({"num_hidden_layers": args.layers} if args.layers else {}))
    result = simulate_step_memory(config, args.arm, batch_size=args.batch_size, seq_len=args.seq_len,
                                  gradient_checkpointing=not args.no_gradient_checkpointing,
                                  chunk_size=args.chunk_size, lines=args.lines, padding_mask=args.padding_mask)
    for i, step in enumerate(result["steps"]):
        phases = ", ".join(f"{k} {v / 2**20:,.1f}" for k, v in step["phase_peaks"].items())
        print(f"step {i}: peak {step['peak_bytes'] / 2**20:,.1f} MiB in {step['phase']} at {step['op']} ({phases})")
    for phase, at in result["steps"][-1]["at_phase_peak"].items():
        print(f"at the {phase} peak ({at['op']}):")
        for label, nbytes in list(at["live"].items())[:args.top]:
            print(f"  {label:70s} {nbytes / 2**20:10.1f} MiB")
    result.update(arm=args.arm, config=bench["name"], layers=config["num_hidden_layers"],
                  batch_size=args.batch_size, seq_len=args.seq_len, chunk_size=args.chunk_size,
                  gradient_checkpointing=not args.no_gradient_checkpointing, padding_mask=args.padding_mask, note=args.note)
    gc_tag = ("" if result["gradient_checkpointing"] else "-no-gc") + ("-padding-mask" if args.padding_mask else "")
    out = args.out or Path(RESULTS_DIR) / f"{time.strftime('%Y-%m-%d')}-{bench['name']}-memory-{args.arm}{gc_tag}.json"
    write_result(out, result)
    return 0


if __name__ == "__main__":
    from fxrewrite.benchmarks.tool_cli import run_cli

    raise SystemExit(run_cli(main))
