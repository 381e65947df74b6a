"""Bring a weight's first bytes into L2 ahead of the kernel that reads it (`fxrewrite.layers.weight_prefetch`).

At one token, a decoder layer's attention is bound by latency, not bandwidth: on an H200, Qwen3-4B's decode
attention and its split merge take ~9 us a layer (profiles in BENCHMARKS.md) while reading ~1 MB, so HBM sits almost
idle for the time it would take to stream ~35 MB. Launched beside the attention (another stream, a parallel branch
of the decode CUDA graph), this kernel asks for the output projection's weight lines to be brought into L2
(PTX ``prefetch.global.L2``: no register result, no wait), so that the o_proj GEMV that follows reads them from L2.
It writes nothing, so it cannot change a result; whether it pays is measured (FXREWRITE_L2_PREFETCH_MB).

Each program asks for BLOCK consecutive 128-byte lines. Reference: `l2_prefetch_ref`, which does nothing (a
prefetch has no result to compare).
"""

from __future__ import annotations

import torch

from fxrewrite.kernels.pdl import LINE_BYTES, prefetch_l2
from fxrewrite.kernels.triton_utils import tl, triton

__all__ = ["l2_prefetch_triton", "l2_prefetch_ref"]

_BLOCK = 1024  # lines a program asks for: 128 KB


def l2_prefetch_ref(weight: torch.Tensor, nbytes: int) -> None:
    """The torch reference: nothing (the prefetch changes no value, only where the bytes are cached)."""


def l2_prefetch_triton(weight: torch.Tensor, nbytes: int) -> None:
    """Ask for the first min(`nbytes`, the weight's size) bytes of `weight` (contiguous, on a CUDA device, any dtype)
    to be brought into L2, on the current stream. ValueError for a non-contiguous weight."""
    if not weight.is_contiguous():
        raise ValueError(f"l2_prefetch: needs a contiguous weight; got strides {weight.stride()}")
    nbytes = min(int(nbytes), weight.numel() * weight.element_size())
    if nbytes <= 0:
        return
    lines = triton.cdiv(nbytes, LINE_BYTES)
    _l2_prefetch_kernel[(triton.cdiv(lines, _BLOCK),)](weight.view(-1).view(torch.uint8), nbytes, BLOCK=_BLOCK,
                                                        LINE=LINE_BYTES, num_warps=4)


@triton.jit
def _l2_prefetch_kernel(ptr, nbytes, BLOCK: tl.constexpr, LINE: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK * LINE + tl.arange(0, BLOCK).to(tl.int64) * LINE
    prefetch_l2(ptr + offsets, offsets < nbytes)
