"""The fused experts' training path through torch's grouped GEMM (``torch.nn.functional.grouped_mm``, torch >= 2.10).

Same computation as :func:`fxrewrite.kernels.fused_moe.fused_experts_ref`: the T*K (token, expert) slots are sorted
by expert (slots routed to experts held elsewhere sort last), x's rows gathered in that order, and two grouped GEMMs
(one group per expert, ``offs`` the cumulative slot counts) compute gate|up and down; SiLU-and-mul between them and
the routing-weighted sum over k are torch ops, so autograd (and, under torch.compile, Inductor) handles the backward:
cuBLAS / CUTLASS grouped GEMMs for the input and weight gradients, no per-expert loop and no host sync. This is the
kernel transformers' own ``grouped_mm`` experts implementation uses (``transformers.integrations.moe``); on the H100 a
Qwen3-30B-A3B training step ran at about half its speed through our Triton grouped GEMM and per-expert weight
gradients (benchmarks/results/2026-12-06-qwen3-30b-a3b-4-layers-train-h100-forty-ninth.json).

Rows past the last group are left undefined by grouped_mm, so those outputs are masked, and the slot rows are padded
to a multiple of 16 (the kernel's 16-byte stride rule for the weight gradient, whose reduction runs over the rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxrewrite.kernels import env_choice

__all__ = ["grouped_mm_applies", "grouped_mm_experts"]

ROW_ALIGN = 16


@torch.compiler.assume_constant_result
def _capability(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


def grouped_mm_applies(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether a training call takes this path: ``FXREWRITE_MOE_TRAIN_GEMM`` is "grouped_mm" (the default; "triton":
    the Triton grouped GEMM), torch has ``F.grouped_mm``, x and both weights are bf16 on a CUDA GPU of compute
    capability 8.0 or newer (grouped_mm's CUDA kernels), and the widths are multiples of 8 (16-byte strides)."""
    if env_choice("FXREWRITE_MOE_TRAIN_GEMM", "grouped_mm", ("grouped_mm", "triton")) != "grouped_mm":
        return False
    if not hasattr(F, "grouped_mm") or not x.is_cuda or not (x.dtype == w13.dtype == w2.dtype == torch.bfloat16):
        return False
    if x.shape[1] % 8 or w2.shape[2] % 8:
        return False
    return _capability(x.device.index if x.device.index is not None else torch.cuda.current_device()) >= 80


def grouped_mm_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, expert_start: int = 0) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K] (float), topk_ids [T, K] int -> [T, H] in x's
    dtype: `fused_experts_ref`'s result, differentiable in x, w13, w2 and topk_weights. Experts ``expert_start ..
    expert_start + E - 1`` are held here; other slots contribute nothing. Routing weights are applied and the K
    experts summed in float32, as the Triton path does. Shapes are not checked here (`fused_experts` checks them);
    a direct call in float32 needs H and I to be multiples of 4 (grouped_mm's 16-byte strides)."""
    t, k = topk_ids.shape
    num_experts, num_slots = w13.shape[0], topk_ids.numel()
    local = topk_ids.reshape(-1) - expert_start
    held = (local >= 0) & (local < num_experts)
    key = torch.where(held, local, num_experts)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)
    counts = counts.scatter_add(0, key, torch.ones_like(key, dtype=torch.int32))[:num_experts]
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    held_sorted = held[order].unsqueeze(1)
    # slots of other ranks' experts: zero rows in (no gradient to x from the kernel's undefined rows past the groups)
    xs = torch.where(held_sorted, x[order // k], 0)
    pad = -num_slots % ROW_ALIGN
    if pad:
        xs = F.pad(xs, (0, 0, 0, pad))
    gate, up = F.grouped_mm(xs, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = F.grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)[:num_slots]
    y = torch.where(held_sorted, y, 0)[torch.argsort(order)]  # back to slot order t*K + k
    return (y.view(t, k, x.shape[1]).float() * topk_weights.float().unsqueeze(-1)).sum(1).to(x.dtype)  # T = 0 too
