"""Fixtures for kernel tests: random paged-KV batches, and the Triton interpreter on a CPU.

triton decides interpreter vs compiler when it is imported (its own ``tl.zeros``/``tl.sum`` are
jit functions), so ``TRITON_INTERPRET=1`` must be in the environment before the first
``import triton``: the root ``tests/conftest.py`` sets it when no GPU is present, before anything
imports triton.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fxrewrite.kernels.triton_utils import HAS_TRITON  # noqa: E402
from tests.triton_cpu import require_interpreter  # noqa: E402



@pytest.fixture
def interpret():
    """Triton kernels run on CPU tensors in this process (`tests.triton_cpu.require_interpreter`)."""
    require_interpreter()


@pytest.fixture
def cuda():
    """Skip unless a CUDA GPU and triton are present (the gpu marker also skips on a CPU)."""
    if not torch.cuda.is_available() or not HAS_TRITON:
        pytest.skip("needs a CUDA GPU and triton")
    return torch.device("cuda")


@dataclasses.dataclass
class PagedBatch:
    """Arguments of paged_attention for sequences given as (cached_len, query_len) pairs."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int

    def args(self):
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.max_query_len, self.max_seq_len)


def make_paged_batch(specs, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32,
                     device="cpu", seed=0) -> PagedBatch:
    """Random K/V in the sequences' slots, NaN everywhere else (a kernel reading a slot it must not
    read turns its output NaN), blocks in shuffled order, padded block-table entries random."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in specs]
    per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(per_seq) + 1
    tables = torch.randint(0, num_blocks, (len(specs), max_blocks), generator=gen)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = order[used:used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kc = torch.full(shape, float("nan"))
    vc = torch.full(shape, float("nan"))
    for b, s in enumerate(seq_lens):
        slots = torch.arange(s)
        blocks = tables[b, slots // block_size]
        kc[blocks, slots % block_size] = torch.randn(s, num_kv_heads, head_dim, generator=gen)
        vc[blocks, slots % block_size] = torch.randn(s, num_kv_heads, head_dim, generator=gen)
    kc, vc = kc.to(dtype), vc.to(dtype)
    q_lens = [q for _, q in specs]
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    return PagedBatch(query.to(device), kc.to(device), vc.to(device), tables.to(torch.int32).to(device),
                      torch.tensor(seq_lens, dtype=torch.int32, device=device), qsl.to(device),
                      max(q_lens), max(seq_lens))


@pytest.fixture
def paged_batch():
    """Factory fixture: ``paged_batch(specs, Hq, Hkv, D, block_size, dtype, device, seed)``."""
    return make_paged_batch
