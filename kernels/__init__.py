"""Triton kernels with plain-torch references of the same signature.

Each module (``rms_norm``, ``activation``, ``rotary``, ``reshape_and_cache``,
``paged_attention``) exposes a public function that dispatches with :func:`use_triton`
and a ``*_ref`` torch function that is the specification. Importing this package never
imports triton; :mod:`fxrewrite.kernels.triton_utils` does, and tolerates its absence.
"""

from __future__ import annotations

import os

import torch

__all__ = ["use_triton", "compiled_training_kernels", "compiled_serving_kernels"]


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
    """
    from fxrewrite.kernels.triton_utils import HAS_TRITON  # here, not above: importing this package skips triton

    if not HAS_TRITON or torch.compiler.is_compiling():
        return False
    if x.is_cuda:
        return True
    if x.device.type != "cpu":  # meta tensors (the tracer's recording run): the reference, which runs on them
        return False
    env = os.environ
    return env.get("FXREWRITE_TRITON") == "1" and env.get("TRITON_INTERPRET") == "1"


def compiled_training_kernels(x: torch.Tensor) -> bool:
    """Whether, while torch.compile traces a training step, the Triton training kernels enter the graph as
    opaque custom ops (``fxrewrite::rms_norm_train``, ``fxrewrite::act_and_mul_train``) instead of their
    torch references: opt-in with ``FXREWRITE_COMPILE_TRAIN_KERNELS=1`` (the training benchmark's
    ``optimize-compile-kernels`` arm), and only where the kernels would run outside tracing.
    ``FXREWRITE_COMPILE_KERNELS=1`` opts in the serving forward too (`compiled_serving_kernels`)."""
    from fxrewrite.kernels.triton_utils import HAS_TRITON

    env = os.environ
    opted_in = "1" in (env.get("FXREWRITE_COMPILE_TRAIN_KERNELS"), env.get("FXREWRITE_COMPILE_KERNELS"))
    if not opted_in or not HAS_TRITON or not torch.compiler.is_compiling():
        return False
    return x.is_cuda or (env.get("FXREWRITE_TRITON") == "1" and env.get("TRITON_INTERPRET") == "1")


def compiled_serving_kernels(x: torch.Tensor) -> bool:
    """Whether, while torch.compile traces an inference forward, RMSNorm and the gated activations enter the
    graph as the opaque Triton ops (``fxrewrite::rms_norm_train``, ``fxrewrite::act_and_mul_train``, their
    forwards) instead of their torch references, which Inductor fuses with the neighbours (the default,
    vLLM's choice too). Opt-in with ``FXREWRITE_COMPILE_KERNELS=1``, to measure one against the other."""
    if not torch.compiler.is_compiling():  # first: this runs in every eager norm and activation call
        return False
    return os.environ.get("FXREWRITE_COMPILE_KERNELS") == "1" and compiled_training_kernels(x)
