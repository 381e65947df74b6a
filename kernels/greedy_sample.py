"""Greedy sampling without a float32 copy of the logits: each row's argmax and its log-softmax in two launches.

The sampler's general path widens the logits to float32, runs log_softmax over them (aten's CUDA kernel reduces a
row inside one thread block: at one row of Qwen3's 151,936 logits one SM walks them three times), takes the argmax
and gathers the chosen entry: five to eight launches and three [S, V] float32 passes through memory. A plain greedy
batch needs only the argmax and the log-softmax at it, log p(t) = x_t - max - log sum_v exp(x_v - max) = -log
sum_v exp(x_v - max) at t = argmax. Here the first launch splits every row into `CHUNK`-wide slices (S x
ceil(V / CHUNK) programs, one read of the logits in their own dtype): each slice's max, its first maximal index and
sum exp(x - slice max); the second launch, one program per row, merges them (the sums rescaled to the row max, the
token = the first slice index attaining it, so ties go to the lowest token id as in `torch.argmax`) and writes the
token and (token id, log-prob) as float64, the layout `SampledTokens` copies to the host. Rows are independent
(batch-invariant). NaN logits are not handled as torch.argmax handles them (it returns a NaN's index).

Reference `greedy_sample_ref`: argmax of the float32 logits and `log_softmax_float32` at it. The two agree on the
token exactly and on the log-prob to float32 rounding (another summation order). `greedy_sample` runs the reference
on a CPU (float64-accurate logprobs there, see `fxrewrite.kernels.log_softmax`), and on CUDA with
`FXREWRITE_GREEDY_KERNEL=off`. On by default on CUDA since its first GPU run (thirty-eighth session, H200): its GPU
tests passed (tokens equal to the reference at Qwen3's vocabulary at 1 / 16 / 256 rows, inside a CUDA graph, and an
engine's greedy tokens with it), 6-7x the reference's speed at 1 and 256 rows, and batch-1 decode +2.1% on Qwen3-4B
and +2.2% on Qwen3-30B-A3B (BENCHMARKS.md).
"""

from __future__ import annotations


import torch

from fxrewrite.kernels import on_off_switch
from fxrewrite.kernels.log_softmax import log_softmax_float32
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["CHUNK", "ENV", "greedy_sample", "greedy_sample_ref", "greedy_sample_triton", "kernel_enabled"]

ENV = "FXREWRITE_GREEDY_KERNEL"

CHUNK = 2048
"""Logits per program of the first launch: Qwen3's vocabulary in 75 slices, so a batch-1 row spreads over most SMs."""


def greedy_sample_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V] (any float dtype) -> (tokens [S] int64: the first maximal index of each row; packed [S, 2]
    float64: the token id and log_softmax(logits.float()) at it)."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    chosen = log_softmax_float32(logits).gather(1, tokens[:, None]).squeeze(1)
    return tokens, torch.stack([tokens.double(), chosen.double()], dim=1)


def greedy_sample_triton(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy_sample_ref`'s contract in two Triton launches; logits [S, V] with unit column stride. ValueError for
    another layout or an empty vocabulary."""
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] == 0:
        raise ValueError(f"greedy_sample: logits {tuple(logits.shape)} strides {logits.stride()}; expected [S, V] "
                         "with V > 0 and unit column stride")
    rows, vocab = logits.shape
    splits = triton.cdiv(vocab, CHUNK)
    dev = logits.device
    part_max = torch.empty(rows, splits, dtype=torch.float32, device=dev)
    part_sum = torch.empty_like(part_max)
    part_idx = torch.empty(rows, splits, dtype=torch.int32, device=dev)
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    packed = torch.empty(rows, 2, dtype=torch.float64, device=dev)
    if rows == 0:
        return tokens, packed
    launch(_slice_kernel, (rows, splits), dev)(logits, logits.stride(0), vocab, part_max, part_sum, part_idx, splits,
                                              CHUNK=CHUNK, num_warps=4)
    launch(_merge_kernel, (rows,), dev)(part_max, part_sum, part_idx, splits, tokens, packed,
                                        BLOCK=next_power_of_2(splits), num_warps=1)
    return tokens, packed


def kernel_enabled() -> bool:
    """Whether `greedy_sample` runs the kernels on CUDA (`ENV`, default on); ValueError naming a bad value."""
    return on_off_switch(ENV, "on")


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [S] int64, packed [S, 2] float64: token id, log-prob) of logits [S, V]: the kernels on CUDA with
    `kernel_enabled()`, the reference otherwise."""
    if logits.is_cuda and kernel_enabled():
        return greedy_sample_triton(logits)
    return greedy_sample_ref(logits)


@triton.jit
def _slice_kernel(x_ptr, stride, V, max_ptr, sum_ptr, idx_ptr, SPLITS, CHUNK: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    cols = part * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    first = tl.argmax(x, axis=0, tie_break_left=True)
    shift = tl.where(m == float("-inf"), 0.0, m)  # a slice of -inf only: its sum is 0, not NaN
    out = row * SPLITS + part
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, tl.sum(tl.exp(x - shift), axis=0))
    tl.store(idx_ptr + out, part * CHUNK + first)


@triton.jit
def _merge_kernel(max_ptr, sum_ptr, idx_ptr, SPLITS, tokens_ptr, packed_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    ok = j < SPLITS
    m = tl.load(max_ptr + row * SPLITS + j, mask=ok, other=float("-inf"))
    s = tl.load(sum_ptr + row * SPLITS + j, mask=ok, other=0.0)
    idx = tl.load(idx_ptr + row * SPLITS + j, mask=ok, other=2147483647)
    top = tl.max(m, axis=0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - top)), axis=0)
    token = tl.min(tl.where(m == top, idx, 2147483647), axis=0)  # slices in order: the lowest maximal id
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(packed_ptr + 2 * row, token.to(tl.float64))
    tl.store(packed_ptr + 2 * row + 1, (-tl.log(total)).to(tl.float64))
