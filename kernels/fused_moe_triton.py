"""Triton grouped GEMM over expert-sorted slots (the kernel behind `fxrewrite.kernels.fused_moe`).

One program computes a [BLOCK_M, BLOCK_N] tile of ``c[slot] = a[slot // a_div] @ b[e]^T`` for a
block of slots that all route to expert ``e`` (`moe_align_block_size` pads each expert's run to a
multiple of BLOCK_M and records the block's expert). ``b`` is read through strides, so a transposed
view (the backward pass) costs no copy. With ``silu_mul`` the program also computes the "up" half
(rows ``n + N/2`` of ``b[e]``) and stores ``silu(gate) * up`` (the SiLU-and-mul epilogue), and
optionally the pre-activation [gate | up] for the backward pass. Accumulation is float32.
The torch specification is `fxrewrite.kernels.fused_moe.fused_experts_ref`.
"""

from __future__ import annotations

import torch

from fxrewrite.kernels.triton_utils import launch, tl, triton

__all__ = ["gemm_config", "grouped_gemm"]


@triton.jit(do_not_specialize=["num_slots"])  # grows with the token count
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, pre_ptr, scale_ptr, sorted_ptr, expert_ptr, num_slots, n_out, k_dim,
                         a_div, stride_am, stride_be, stride_bn, stride_bk, half,
                         SILU: tl.constexpr, SAVE_PRE: tl.constexpr, SCALE: tl.constexpr, PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    expert = tl.load(expert_ptr + pid_m)
    if expert < 0:
        return
    slot = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = slot < num_slots
    row = tl.where(m_mask, slot // a_div, 0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_dim
        a = tl.load(a_ptr + row[:, None] * stride_am + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        b_mask = k_mask[:, None] & n_mask[None, :]
        b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk, mask=b_mask, other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
        if SILU:
            b_up = tl.load(b_base + (offs_n[None, :] + half) * stride_bn + offs_k[:, None] * stride_bk, mask=b_mask,
                           other=0.0)
            acc_up += tl.dot(a, b_up, input_precision=PRECISION)
    out_mask = m_mask[:, None] & n_mask[None, :]
    slot64 = slot.to(tl.int64)
    if SILU:
        if SAVE_PRE:
            pre = pre_ptr + slot64[:, None] * (2 * half) + offs_n[None, :]
            tl.store(pre, acc.to(pre_ptr.dtype.element_ty), mask=out_mask)
            tl.store(pre + half, acc_up.to(pre_ptr.dtype.element_ty), mask=out_mask)
        acc = acc * tl.sigmoid(acc) * acc_up
    if SCALE:  # the routed weight of each slot, applied in float32 before the store
        acc = acc * tl.load(scale_ptr + slot, mask=m_mask, other=0.0)[:, None]
    tl.store(c_ptr + slot64[:, None] * n_out + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=out_mask)


def gemm_config(num_tokens: int) -> dict:
    """Tile sizes for `grouped_gemm` by the number of tokens T in the batch (T*K slots).

    Few tokens: each expert gets a row or two, so the row block is small and the work is a GEMV
    over the expert's weights (long K tiles, several stages in flight to cover HBM latency); many
    tokens: large tiles, more reuse per loaded weight tile. Candidates from the shape of vLLM's tuned
    H200 table for E=128, N=768 (``fused_moe/configs``), picked by `fxrewrite.benchmarks.moe_kernels
    --sweep` on an H200 (benchmarks/results/2026-11-30-moe-kernels-qwen3-30b-a3b-sweep.json);
    ``block_n`` counts output columns, and the SiLU GEMM loads two weight tiles (gate, up) per block.
    """
    if num_tokens <= 32:
        return dict(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4)
    if num_tokens <= 96:
        return dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if num_tokens <= 256:
        return dict(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if num_tokens <= 768:
        return dict(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)
    return dict(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=4)


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
                 num_slots: int, *, a_div: int, block_m: int, silu_mul: bool = False, save_pre: bool = False,
                 block_n: int = 64, block_k: int = 32, num_warps: int = 4, num_stages: int = 3,
                 scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, zero_fill: bool = True,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """a [M, K] (row-contiguous), b [E, N, K] (any strides) -> (c [num_slots, N or N/2], pre or None).

    Row ``s`` of c (s < num_slots, a (token, expert) slot) is ``a[s // a_div] @ b[e]^T`` where e is
    the expert of the block holding s in `sorted_ids`, times ``scale[s]`` when `scale` (float32
    [num_slots]) is given. With `silu_mul`, c holds silu(gate) * up over the two halves of N, and
    `save_pre` also returns the pre-activation [num_slots, N]. Output dtype: `out_dtype` or a's.
    Slots in no block (routed to another rank's experts) are zero, or undefined without `zero_fill`.
    """
    a = a.contiguous()
    n = b.shape[1]
    n_out = n // 2 if silu_mul else n
    alloc = torch.zeros if zero_fill else torch.empty
    c = alloc((num_slots, n_out), dtype=out_dtype or a.dtype, device=a.device)
    pre = alloc((num_slots, n), dtype=a.dtype, device=a.device) if silu_mul and save_pre else None
    if num_slots == 0:
        return c, pre
    block_n = min(block_n, max(16, triton.next_power_of_2(n_out)))
    block_k = min(block_k, max(16, triton.next_power_of_2(a.shape[1])))
    grid = (expert_ids.numel(), triton.cdiv(n_out, block_n))
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    launch(_grouped_gemm_kernel, grid, a.device)(
        a, b, c, pre if pre is not None else c, scale if scale is not None else c, sorted_ids, expert_ids,
        num_slots, n_out, a.shape[1], a_div, a.stride(0), b.stride(0), b.stride(1), b.stride(2), n_out,
        SILU=silu_mul, SAVE_PRE=pre is not None, SCALE=scale is not None, PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return c, pre
