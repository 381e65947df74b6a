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
- paged attention: prefill and decode run ONE Triton kernel (`paged_prefill_triton`) with fixed query
  and key tiles (`fxrewrite.kernels.paged_attention.BI_TILES`) and no split-K, so a query's reduction
  over its keys walks the same key tiles from position 0 whether it ran in a chunked prefill, a decode
  step or a trainer's full-sequence forward (`causal_attention_batch_invariant`); the CPU reference
  attends one sequence at a time;
- log_softmax over the last dim (the sampler's logprobs and a trainer's recomputation) runs one
  Triton program per row with fixed chunks (`log_softmax_batch_invariant`) on CUDA;
- RMSNorm (one row per Triton program, or a per-row torch reduction) is batch invariant already; the
  rotary (and q/k-norm + rotary) modules of the rewrite take the training kernels' forward inside the mode,
  so the engine rounds exactly as a trainer's autograd forward does (`fxrewrite.patterns.rotary`).
Cost: several GEMM launches per projection (a decode batch of 256 rows = 4 launches on a GPU), no
split-K parallelism in decode attention, and 16-row query tiles of which a decode step uses one.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fxrewrite.kernels import use_triton
from fxrewrite.kernels.log_softmax import log_softmax_float32
from fxrewrite.kernels.triton_utils import launch, tl, triton

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


_LOG_SOFTMAX_BLOCK = {"cuda": 1024, "cpu": 1 << 16}
"""Vocabulary entries per step of the log_softmax kernel's loop, by device type (fixed: the reduction
order of a row depends on its length only; the interpreter on a CPU takes bigger, fewer steps)."""


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, n_cols, x_s0, o_s0, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = tl.zeros([BLOCK], dtype=tl.float32) - float("inf")
    for c0 in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row * x_s0 + c0 + cols, mask=c0 + cols < n_cols, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, x)
    row_max = tl.max(m, axis=0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row * x_s0 + c0 + cols, mask=c0 + cols < n_cols, other=float("-inf")).to(tl.float32)
        acc += tl.exp(x - row_max)
    lse = row_max + tl.log(tl.sum(acc, axis=0))
    for c0 in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row * x_s0 + c0 + cols, mask=c0 + cols < n_cols, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * o_s0 + c0 + cols, (x - lse).to(out_ptr.dtype.element_ty), mask=c0 + cols < n_cols)


def log_softmax_batch_invariant_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference: x [..., V] -> log_softmax over V, float32 result (float64 sums on a CPU:
    `fxrewrite.kernels.log_softmax`), x's dtype. Per row, so batch invariant."""
    return log_softmax_float32(x).to(x.dtype)


def log_softmax_batch_invariant(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim of x [..., V] (x's dtype, float32 math): one Triton program per row
    walking V in fixed chunks (`_LOG_SOFTMAX_BLOCK`; max, sum of exp, subtract), so a row's value never
    depends on the other rows; the torch reference where `use_triton` says no."""
    if not use_triton(x) or x.numel() == 0:
        return log_softmax_batch_invariant_ref(x)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    launch(_log_softmax_kernel, (rows.shape[0],), x.device)(
        rows, out, rows.shape[1], rows.stride(0), out.stride(0),
        BLOCK=_LOG_SOFTMAX_BLOCK.get(x.device.type, 1024), num_warps=8)
    return out.view(x.shape)


class _LogSoftmaxBackward(torch.autograd.Function):
    """Forward: the batch-invariant kernel; backward: dx = dy - exp(y) * sum(dy) (per row)."""

    @staticmethod
    def forward(ctx, x):
        y = log_softmax_batch_invariant(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return dy - torch.exp(y) * dy.sum(-1, keepdim=True)


_LOG_SOFTMAXES = (torch.log_softmax, F.log_softmax, torch.Tensor.log_softmax, torch.nn.functional.log_softmax)


def _log_softmax_call(args, kwargs):
    """(input, dtype) when a log_softmax call is over the last dim, else None (left to torch)."""
    x = args[0] if args else kwargs.get("input")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    dtype = args[3] if len(args) > 3 else (args[2] if len(args) == 3 and not isinstance(args[2], int) else kwargs.get("dtype"))
    if not isinstance(x, torch.Tensor) or dim is None or dim not in (-1, x.dim() - 1):
        return None
    return x, dtype


class _BatchInvariantFunctions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear_batch_invariant(*args, **kwargs)
        if func in _LOG_SOFTMAXES:
            call = _log_softmax_call(args, kwargs)
            if call is not None:
                x, dtype = call
                x = x.to(dtype) if dtype is not None else x
                return _LogSoftmaxBackward.apply(x) if torch.is_grad_enabled() and x.requires_grad \
                    else log_softmax_batch_invariant(x)
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
