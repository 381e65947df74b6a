"""Triton kernels with plain-torch references of the same signature.

Each module (``rms_norm``, ``activation``, ``rotary``, ``reshape_and_cache``,
``paged_attention``) exposes a public function that dispatches with :func:`use_triton`
and a ``*_ref`` torch function that is the specification. Importing this package never
imports triton; :mod:`fxrewrite.kernels.triton_utils` does, and tolerates its absence.
"""

from __future__ import annotations

import os

import torch

__all__ = ["use_triton", "triton_runs_on", "compiled_training_kernels", "compiled_serving_kernels", "on_off_switch",
           "env_choice"]


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """The environment switch `name` (`default` when unset), one of `choices`; ValueError naming the variable, its
    value and the choices otherwise (every FXREWRITE_* switch with a fixed set of values reads through here)."""
    value = os.environ.get(name, default)
    if value not in choices:
        quoted = [repr(choice) for choice in choices]
        alternatives = ", ".join(quoted[:-1]) + " or " + quoted[-1] if len(quoted) > 1 else quoted[0]
        raise ValueError(f"{name}={value!r}: expected {alternatives}")
    return value


def on_off_switch(name: str, default: str) -> bool:
    """The on/off environment switch `name` (`default` when unset): True for "on"; ValueError as :func:`env_choice`."""
    return env_choice(name, default, ("on", "off")) == "on"


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernel should run for a call whose main input is ``x``.

    True when ``x`` is a CUDA tensor and triton is importable; on a CPU only when forced
    with ``FXREWRITE_TRITON=1`` together with ``TRITON_INTERPRET=1`` (the kernels then run in
    triton's interpreter, which is how the CPU tests compare them with the references).
    Otherwise the torch reference runs.

    While torch.compile traces (``torch.compiler.is_compiling()``) the reference runs too: Inductor
    then sees plain torch ops and fuses the norms, activations and rotary into its own kernels along
    with their neighbours (vLLM compiles its custom ops' native forms for the same reason). Attention
    is an opaque custom op, so its kernels still run.
    Under torch.func transforms (`functorch_active`) the reference runs as well.
    """
    return not torch.compiler.is_compiling() and not functorch_active() and triton_runs_on(x)


def functorch_active() -> bool:
    """Whether a torch.func transform (grad, vmap, jacrev...) is running: the fused layers then take their torch
    references, which functorch transforms, because their autograd Functions are written in the ctx-in-forward
    form functorch refuses ("must override the setup_context staticmethod"). A C flag read: cheap."""
    return torch._C._are_functorch_transforms_active()


def triton_runs_on(x: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on ``x``'s device, tracing or not: triton importable and ``x`` a CUDA
    tensor, or a CPU tensor with ``FXREWRITE_TRITON=1`` and ``TRITON_INTERPRET=1`` (see :func:`use_triton`)."""
    from fxrewrite.kernels.triton_utils import HAS_TRITON  # here, not above: importing this package skips triton

    if not HAS_TRITON:
        return False
    if x.is_cuda:
        return True
    if x.device.type != "cpu":  # meta tensors (the tracer's recording run): the reference, which runs on them
        return False
    env = os.environ
    return env.get("FXREWRITE_TRITON") == "1" and env.get("TRITON_INTERPRET") == "1"


def compiled_training_kernels(x: torch.Tensor) -> bool:
    """Whether, while torch.compile traces a training step, the Triton training kernels enter the graph as
    opaque custom ops (``fxrewrite::rms_norm_train``, ``act_and_mul_train``, ``act_and_mul_down_train``,
    ``qk_norm_rope_train``, each with its backward op) instead of their torch references: the default wherever
    the kernels would run outside tracing, so that ``torch.compile(optimize(model))`` saves for the backward what
    the eager step saves and runs its kernels, Inductor fusing only the code between them (vLLM's and Liger's
    design for training). ``FXREWRITE_COMPILE_TRAIN_KERNELS=0``: Inductor compiles the references instead (the
    training benchmark's ``optimize-compile-inductor`` arm). ``FXREWRITE_COMPILE_KERNELS=1`` opts in the serving
    forward too (`compiled_serving_kernels`)."""
    env = os.environ
    if env.get("FXREWRITE_COMPILE_TRAIN_KERNELS") == "0" and env.get("FXREWRITE_COMPILE_KERNELS") != "1":
        return False
    return torch.compiler.is_compiling() and not functorch_active() and triton_runs_on(x)


def compiled_serving_kernels(x: torch.Tensor) -> bool:
    """Whether, while torch.compile traces an inference forward, RMSNorm and the gated activations enter the
    graph as the opaque Triton ops (``fxrewrite::rms_norm_train``, ``fxrewrite::act_and_mul_train``, their
    forwards) instead of their torch references, which Inductor fuses with the neighbours (the default,
    vLLM's choice too). Opt-in with ``FXREWRITE_COMPILE_KERNELS=1``, to measure one against the other."""
    if not torch.compiler.is_compiling():  # first: this runs in every eager norm and activation call
        return False
    return os.environ.get("FXREWRITE_COMPILE_KERNELS") == "1" and compiled_training_kernels(x)


def _installed_kernels_in_place() -> None:
    """This folder is ``fxrewrite.kernels``. Imported as a top-level ``kernels`` (this checkout's root on sys.path:
    ``python -m`` or pytest run from it) it would shadow Hugging Face's ``kernels`` package, which transformers >= 5.25
    installs and imports at load (``from kernels import CUDAProperties``): when that package is installed it is
    loaded under the name instead (a module may replace itself in sys.modules while it runs)."""
    import importlib.machinery
    import importlib.util
    import sys

    here = os.path.realpath(__file__)  # real paths: the checkout may be on sys.path twice, once through a link
    root = os.path.dirname(os.path.dirname(here))
    spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.realpath(p or os.curdir) != root])
    if spec is not None and spec.loader is not None and os.path.realpath(spec.origin or "") != here:
        module = importlib.util.module_from_spec(spec)
        sys.modules["kernels"] = module
        spec.loader.exec_module(module)


if __name__ == "kernels":
    _installed_kernels_in_place()
