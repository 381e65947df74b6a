"""Batch-invariant mode: one row's result does not depend on how many other rows share the batch.

Why (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025): a GEMM library picks its
kernel, tile and split-K by the problem's M, and a split attention picks its split count by the batch,
so the same token's logits change in the last bits with the batch it ran in; sampled-token logprobs
then differ from a recomputation. Kernels are batch invariant when the reduction order for a row is
fixed: matmul without M-dependent tiling or split-K, RMSNorm with one row per program, attention with
a split size that does not depend on the batch. vLLM's `VLLM_BATCH_INVARIANT` mode replaces aten's mm /
addmm / log_softmax / mean with Triton kernels of fixed tiling for the same reason.

What this mode does (`batch_invariant_mode()`, entered by the engine for every step when
`LLM(batch_invariant=True)`, and usable around a trainer's recomputation):
- `F.linear` (every projection and the LM head) runs its rows in chunks of a fixed row count
  (`ROWS_CUDA` on a GPU, 1 on a CPU), the last chunk zero padded: every chunk is the same GEMM call
  shape, so the library runs the same kernel, and a row's dot products keep one order whatever M is;
- paged attention: the CPU reference attends one sequence at a time (no batched decode padded to the
  longest context); the Triton decode kernel runs one split per (sequence, kv head), so a sequence's
  reduction depends on its own context only;
- RMSNorm (one row per Triton program, or a per-row torch reduction) and the sampler's float32
  log_softmax (per row) are batch invariant already.
Cost: several GEMM launches per projection (a decode batch of 256 rows = 4 launches on a GPU) and no
split-K parallelism in decode attention.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROWS_CUDA = 64
"""Rows per GEMM call on CUDA (the decode CUDA-graph buckets 16..512 pad to at most 63 extra rows)."""

_state = threading.local()


def is_batch_invariant() -> bool:
    """Whether this thread runs inside `batch_invariant_mode()`."""
    return getattr(_state, "depth", 0) > 0


def linear_batch_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` (x [..., K], weight [N, K], bias [N] -> [..., N]) with fixed-size row chunks: the result
    of a row is bitwise the same whatever the other rows are."""
    rows = x.reshape(-1, x.shape[-1])
    chunk = ROWS_CUDA if x.is_cuda else 1
    num = rows.shape[0]
    pad = -num % chunk
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    w_t = weight.t()
    out = torch.cat([torch.mm(part, w_t) for part in rows.split(chunk)]) if num else rows.new_zeros(0, weight.shape[0])
    out = out[:num]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


class _BatchInvariantFunctions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear_batch_invariant(*args, **kwargs)
        return func(*args, **kwargs)


@contextmanager
def batch_invariant_mode(enabled: bool = True):
    """Run the block with batch-invariant kernels (see the module docstring); a no-op when not `enabled`.
    Thread-local, re-entrant."""
    if not enabled:
        yield
        return
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        with _BatchInvariantFunctions():
            yield
    finally:
        _state.depth -= 1
