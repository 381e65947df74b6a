"""Programmatic Dependent Launch (PDL) for the decode-step Triton kernels (Hopper, sm90+).

Without PDL a kernel starts only after the previous kernel on the stream has finished and its memory
is flushed, so each of the ~10 launches per decoder layer pays a ramp-up and a tail of a few
microseconds. A kernel launched with PDL (CUDA's programmatic stream serialization, Triton's
``launch_pdl=True``) may start while the previous one is still running: it does the work that does not
depend on the previous kernel (a GEMV prefetches its first weight lines to L2), then ``gdc_wait`` blocks until the
previous grid has completed and its writes are visible; ``gdc_launch_dependents`` lets the next kernel
launch once every program of this one has called it. Both instructions are no-ops in a kernel launched
without the attribute, and a launch without it (cuBLAS, torch ops) keeps full stream ordering, so mixing
PDL and plain kernels is safe. CUDA graphs capture the programmatic edges.

Kernels with the switch (a ``PDL`` constexpr, set from `pdl_enabled`): the skinny and pipelined GEMVs (float and
FP8), RMSNorm, SiLU-and-mul, rotary, q/k norm + rotary (+ cache write), reshape_and_cache, paged decode and its
merge, the MoE router (and its norm-folded form), the direct expert kernels, and the FP8 activation quantization
(RMSNorm / SiLU-and-mul that quantize, the per-token quantization; fp8_quant_fused.py, fp8_rowwise.py). cuBLAS, the
Triton GEMMs and torch's own kernels launch plainly.

The rules every PDL kernel here follows (CUDA programming guide, "Programmatic Dependent Launch"):
every program calls ``gdc_wait`` (unconditionally, so that the grid's completion implies its
predecessor's, which the next kernel relies on) before it reads anything another kernel may have
written and before it writes anything; only read-only data (weights) is touched before it, and, under
`early_loads`, data that only kernels before the previous one wrote: the previous kernel let this one launch only
after its own wait (or, launched plainly, after its predecessors had finished), so those writers have completed and
their writes are visible. The step metadata the engine copies in before a forward is such data (the paged decode
kernel, q/k norm + rotary + cache write).

``FXREWRITE_PDL``: ``auto`` (default: on for CUDA devices of compute capability >= 9.0, except that the FP8 GEMVs
launch plainly and only let the next kernel launch early, `fp8_gemv_pdl`), ``on`` (every kernel above, the FP8
GEMV too; a device without PDL raises), ``off``. Never under the Triton interpreter (CPU tests).

Measured (H200, triton 3.6, `benchmarks/latency_ab.sh`, batch-1 decode, native arm, off -> auto in one call):
with the skinny GEMV of 2026-12-01 it bought nothing (76.5 / 75.1 us per Qwen3-4B layer); with the pipelined GEMV
prefetching before its wait (2026-12-03) Qwen3-30B-A3B 338.5 -> 359.8 tokens/s, Qwen3-4B 340.2 -> 344.7,
Qwen3-32B 61.2 -> 61.7, but Qwen3-32B on 128 x 128 block-scaled FP8 weights 97.1 -> 94.9 (every GEMV the FP8 one):
so under ``auto`` the FP8 GEMV launches plainly. It still triggers its dependents (2026-12-04, one call, FP8 GEMV
plain / launched with PDL / plain but triggering: 97.7 / 94.1 / 99.1 tokens/s; with PDL and 128 prefetch bytes 95.0
in the next call: the early launch, not the prefetch, costs). Early loads (`early_loads`, FXREWRITE_PDL_EARLY
off -> on, one call each, 2026-12-04-pdl-early-loads-thirty-fourth.log): Qwen3-4B 365.1 -> 372.9 tokens/s,
Qwen3-30B-A3B 383.7 -> 401.0, Qwen3-32B block-FP8 102.7 -> 103.3 (graph replay 9.075 -> 8.988 ms); the same
prefetch for the MoE down kernel's routed experts (398.9 against 401.0) was not kept. tests/gpu/test_gpu_pdl.py
(kernel chains in captured graphs, whole bf16 Qwen3 / Qwen3-MoE engines) gives bitwise the outputs with and without
PDL.
"""

from __future__ import annotations

import functools
import os

import torch

from fxrewrite.kernels import env_choice, on_off_switch
from fxrewrite.kernels.triton_utils import HAS_TRITON, interpreter_ready, next_power_of_2, tl, triton

__all__ = ["MODES", "mode", "device_supports_pdl", "pdl_enabled", "fp8_gemv_pdl", "early_loads", "check_environment",
           "gdc_prologue", "prefetch_l2", "prefetch_bytes", "prefetch_lines", "LINE_BYTES"]

MODES = ("auto", "on", "off")


def mode() -> str:
    """``FXREWRITE_PDL``: "auto" (default), "on" or "off"; ValueError naming any other value."""
    return env_choice("FXREWRITE_PDL", "auto", MODES)


@functools.lru_cache(maxsize=None)
def _capability_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def device_supports_pdl(device) -> bool:
    """True for a CUDA device of compute capability >= 9.0 with compiled (not interpreted) Triton."""
    device = torch.device(device)
    if device.type != "cuda" or not HAS_TRITON or interpreter_ready():
        return False
    return _capability_ok(device.index if device.index is not None else torch.cuda.current_device())


def pdl_enabled(device, in_auto: bool = True) -> bool:
    """Whether a decode kernel launches with PDL on `device` (see the module docstring); `in_auto` False for a
    kernel that launches with it only under FXREWRITE_PDL=on (measured slower with it). RuntimeError under
    FXREWRITE_PDL=on on a device without it. Memoised per (FXREWRITE_PDL value, device, in_auto): every kernel
    launch asks."""
    key = (os.environ.get("FXREWRITE_PDL", "auto"), device, in_auto)
    hit = _ENABLED.get(key)
    if hit is None:
        current = mode()
        supported = (current == "on" or (current == "auto" and in_auto)) and device_supports_pdl(device)
        if current == "on" and not supported:
            raise RuntimeError(f"FXREWRITE_PDL=on but device {device} has no programmatic dependent launch "
                               "(needs CUDA compute capability >= 9.0 and compiled Triton); use auto or off")
        hit = _ENABLED[key] = supported
    return hit


_ENABLED: dict = {}

FP8_GEMV_FORMS = ("plain", "trigger", "full")


def fp8_gemv_pdl(device) -> tuple[bool, bool]:
    """(launch with PDL, let the next kernel launch early) for the FP8 GEMVs on `device`. Under FXREWRITE_PDL=on
    both, under off neither; under auto ``FXREWRITE_PDL_FP8_GEMV`` picks (for measurements): "trigger" (default:
    launched plainly, so it starts after its predecessor has finished, but it calls ``gdc_launch_dependents`` so
    the PDL kernel after it may launch during its last wave), "plain" (neither) or "full" (both, as under on).
    ValueError naming any other value."""
    form = env_choice("FXREWRITE_PDL_FP8_GEMV", "trigger", FP8_GEMV_FORMS)
    if mode() != "auto" or not pdl_enabled(device):
        on = pdl_enabled(device, in_auto=False)
        return on, on
    return form == "full", form != "plain"



def early_loads(pdl: bool, static_inputs: bool) -> bool:
    """Whether a PDL kernel whose caller promises `static_inputs` (its step metadata, e.g. positions, slot mapping,
    block tables, sequence lengths, was not written by the kernel launched just before it: an engine step's
    metadata is copied in before the forward) reads that metadata and the constants (cos / sin tables, norm
    weights) before ``gdc_wait``, and prefetches what its first loads will need towards L2, so that the chain of
    dependent loads runs during the previous kernel's tail instead of after it. Only with `pdl` (else nothing runs
    early anyway). ``FXREWRITE_PDL_EARLY`` "on" (default) / "off" (for measurements); ValueError naming any other
    value."""
    return on_off_switch("FXREWRITE_PDL_EARLY", "on") and pdl and static_inputs


@triton.jit
def gdc_prologue(PDL: tl.constexpr):
    """In a kernel launched with PDL: wait for the previous grid (its writes become visible), then let the
    next kernel launch. Call it before the first read of another kernel's output and the first write."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


LINE_BYTES = 128


def prefetch_bytes() -> int:
    """With PDL, each GEMV program asks for up to this many bytes of each of its weight rows (whole 128-byte lines,
    its first K columns) to be brought into L2 before it waits on the previous kernel: ~1000 resident programs x
    4-8 rows ~ 8-16 MB in flight during the previous kernel's tail, well inside the 50 MB L2. 2048, or
    ``FXREWRITE_PDL_PREFETCH_BYTES`` (for measurements; ValueError naming a value that is not a whole number
    >= 128). More is slower (H200, batch-1 native, 2026-12-03-pdl-prefetch-sweep-twentyfourth.log): 2048 / 8192 /
    65536 bytes gave Qwen3-30B-A3B 359.9 / 342.7 / 342.6 tokens/s, Qwen3-4B 344.2 / 319.5 / 318.9; less than 2048
    was not measured."""
    return _parse_prefetch_bytes(os.environ.get("FXREWRITE_PDL_PREFETCH_BYTES", "2048"))


@functools.lru_cache(maxsize=None)
def _parse_prefetch_bytes(raw: str) -> int:
    value = int(raw) if raw.isascii() and raw.isdigit() else -1
    if value < LINE_BYTES:
        raise ValueError(f"FXREWRITE_PDL_PREFETCH_BYTES={raw!r}: expected a whole number of bytes >= {LINE_BYTES} "
                         "(default 2048)")
    return value


def check_environment(device) -> None:
    """FXREWRITE_PDL, FXREWRITE_PDL_PREFETCH_BYTES, FXREWRITE_PDL_EARLY and FXREWRITE_PDL_FP8_GEMV checked once (an
    engine's start), not first at a kernel launch: ValueError naming a bad value, RuntimeError for ``on`` on a device
    without PDL."""
    prefetch_bytes()
    early_loads(False, False)
    pdl_enabled(device)
    fp8_gemv_pdl(device)


def prefetch_lines(k_per_program: int, element_size: int) -> int:
    """Cache lines of one weight row to prefetch (a power of two, >= 1)."""
    lines = min(prefetch_bytes(), k_per_program * element_size) // LINE_BYTES
    return max(1, next_power_of_2(lines) // 2 if next_power_of_2(lines) > lines else lines)


@triton.jit
def prefetch_l2(ptrs, mask):
    """PTX ``prefetch.global.L2`` of every pointer where mask is set (no register result, no wait)."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
