"""Fused mixture-of-experts: routing top-k, token alignment by expert, grouped GEMMs with SiLU-and-mul.

The computation (transformers' experts modules, e.g. ``Qwen3MoeExperts``)::

    out[t] = sum_k w[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = ids[t, k]
    with w13[e] = [gate_e | up_e] of shape [2I, H] and w2[e] of shape [H, I].

`fused_experts_ref` is the specification (one matmul pair per expert, torch ops, differentiable).
`fused_experts` runs the Triton path on CUDA (or the interpreter, for tests): the T*K (token,
expert) slots are sorted by expert and padded per expert to a multiple of the GEMM row block
(`moe_align_block_size`, static shapes: no host sync, CUDA-graph safe), then one grouped GEMM
gathers rows of x per block of slots against that block's expert weights with SiLU-and-mul in its
epilogue, and a second one applies w2 and the routing weight. The backward pass reuses the grouped
GEMM (weights read transposed through strides) for the input gradients; the weight gradients are
per-expert matmuls over the sorted slots. Design facts from vLLM's
``vllm/model_executor/layers/fused_moe/fused_moe.py`` (sorted-token grouped GEMM, per-block expert
id, routed weight applied in the second GEMM); the code is our own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fxrewrite.kernels import triton_runs_on, use_triton
from fxrewrite.kernels.batch_invariant import is_batch_invariant
from fxrewrite.kernels.fused_moe_direct import DIRECT_MAX_TOKENS, direct_experts
from fxrewrite.kernels.fused_moe_grouped_mm import grouped_mm_applies, grouped_mm_experts
from fxrewrite.kernels.fused_moe_triton import gemm_config, grouped_gemm
from fxrewrite.kernels.moe_routing import SCORING, moe_align_block_size, select_experts

__all__ = ["SCORING", "select_experts", "moe_align_block_size", "fused_experts", "fused_experts_ref"]

def fused_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, expert_start: int = 0) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights/ids [T, K] -> [T, H] in x's dtype.

    Experts ``expert_start .. expert_start + E - 1`` are the ones held here (expert parallelism);
    slots routed elsewhere contribute nothing. Differentiable in x, w13, w2 and topk_weights.
    """
    _check(x, w13, w2, topk_weights, topk_ids)
    num_experts, out = w13.shape[0], torch.zeros_like(x)
    local = topk_ids - expert_start
    for e in range(num_experts):
        token, slot = torch.where(local == e)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * topk_weights[token, slot, None]
        out = out.index_add(0, token, y.to(x.dtype))
    return out


def _check(x, w13, w2, topk_weights, topk_ids) -> None:
    e, two_i, h = w13.shape
    if x.dim() != 2 or x.shape[1] != h or tuple(w2.shape) != (e, h, two_i // 2) or two_i % 2:
        raise ValueError(f"fused_experts: expected x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got x {tuple(x.shape)}, "
                         f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_experts: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T={x.shape[0]}, K]")


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_start: int = 0, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `fused_experts_ref`; Triton kernels when `use_triton(x)`, else the reference. With
    `residual` (x's shape; ValueError otherwise): ``residual + <the experts' output>``, the decoder layer's closing
    add, done in the direct path's down-kernel epilogue (`fused_moe_direct.direct_down`) and by torch on every
    other path (and for a residual of another dtype, as under autocast: torch's type promotion).

    At inference, up to `DIRECT_MAX_TOKENS` tokens take the direct path (`fused_moe_direct`: two
    GEMV launches indexed by the top-k ids, combine fused); more tokens, or autograd, the grouped
    GEMMs. In training with bf16 on a GPU, torch's grouped GEMM (`fused_moe_grouped_mm`, eager and under
    torch.compile; FXREWRITE_MOE_TRAIN_GEMM=triton for the Triton path below). Differentiable (an autograd
    Function, or torch ops) in x, w13, w2 and topk_weights on every path. In
    `batch_invariant_mode` the reference on every path (its per-expert F.linear calls are the mode's fixed-chunk
    GEMMs, its combine adds a token's experts in id order), so the engine's decode and prefill and a trainer's
    recomputation round alike.

    While torch.compile traces, the Triton paths enter the graph as opaque custom ops (``fxrewrite::fused_experts``
    at inference, ``fxrewrite::fused_experts_train`` and its backward op in training; no graph break); the
    reference, whose routing is data-dependent, runs eagerly behind a graph break.
    """
    _check(x, w13, w2, topk_weights, topk_ids)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"fused_experts: residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    if residual is not None and residual.dtype != x.dtype:  # autocast: torch's add promotes, as the layer's would
        return residual + fused_experts(x, w13, w2, topk_weights, topk_ids, expert_start)
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (x, w13, w2, topk_weights))
    if training and x.shape[0] > 0 and grouped_mm_applies(x, w13, w2) and not is_batch_invariant():
        out = grouped_mm_experts(x, w13, w2, topk_weights, topk_ids, expert_start)  # traced by dynamo as it is
    elif torch.compiler.is_compiling() and triton_runs_on(x) and not is_batch_invariant():
        if training:
            out = torch.ops.fxrewrite.fused_experts_train(x, w13, w2, topk_weights, topk_ids, expert_start)[0]
        else:
            out = torch.ops.fxrewrite.fused_experts(x, w13, w2, topk_weights, topk_ids, expert_start)
    else:
        return _fused_experts_eager(x, w13, w2, topk_weights, topk_ids, expert_start, residual)
    return out if residual is None else residual + out


@torch.compiler.disable(reason="fused_experts: the reference's routing is data-dependent")
def _fused_experts_eager(x, w13, w2, topk_weights, topk_ids, expert_start: int, residual=None) -> torch.Tensor:
    if not use_triton(x) or x.shape[0] == 0 or is_batch_invariant():
        out = fused_experts_ref(x, w13, w2, topk_weights, topk_ids, expert_start)
    elif torch.is_grad_enabled() and any(t.requires_grad for t in (x, w13, w2, topk_weights)):
        out = _FusedExperts.apply(x, w13, w2, topk_weights, topk_ids, expert_start)
    elif x.shape[0] <= DIRECT_MAX_TOKENS:
        return direct_experts(x, w13, w2, topk_weights, topk_ids, expert_start, residual=residual)
    else:
        out = _forward(x, w13, w2, topk_weights, topk_ids, expert_start, save=False)[0]
    return out if residual is None else residual + out


def _forward(x, w13, w2, topk_weights, topk_ids, expert_start: int, save: bool):
    """Triton forward: align, grouped GEMM (SiLU-and-mul epilogue), grouped GEMM, weighted sum over k.

    Inference (`save` False): the routed weight is applied in the second GEMM's epilogue, which
    writes float32, and the first GEMM's output is not zero-filled (only its sorted slots are read).
    Training keeps the unweighted expert outputs for the routing weights' gradient."""
    t, k = topk_ids.shape
    num_experts = w13.shape[0]
    cfg = gemm_config(t)
    block_m, tiles = cfg["block_m"], {key: v for key, v in cfg.items() if key != "block_m"}
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, block_m, num_experts, expert_start)
    act, h13 = grouped_gemm(x, w13, sorted_ids, expert_ids, t * k, a_div=k, block_m=block_m, silu_mul=True,
                            save_pre=save, zero_fill=save, **tiles)
    if not save:
        y = grouped_gemm(act, w2, sorted_ids, expert_ids, t * k, a_div=1, block_m=block_m, out_dtype=torch.float32,
                         scale=topk_weights.reshape(-1).float(), **tiles)[0]
        return y.view(t, k, -1).sum(1).to(x.dtype), None
    y = grouped_gemm(act, w2, sorted_ids, expert_ids, t * k, a_div=1, block_m=block_m, **tiles)[0]
    out = (y.float().view(t, k, -1) * topk_weights.float().view(t, k, 1)).sum(1).to(x.dtype)
    return out, (sorted_ids, expert_ids, act, h13, y, k, block_m, expert_start)


class _FusedExperts(torch.autograd.Function):
    """Triton forward; backward with the grouped GEMM for input grads, per-expert matmuls for weights."""

    @staticmethod
    def forward(ctx, x, w13, w2, topk_weights, topk_ids, expert_start):
        out, saved = _forward(x, w13, w2, topk_weights, topk_ids, expert_start, save=True)
        ctx.save_for_backward(x, w13, w2, topk_weights, *saved[:5])
        ctx.meta = saved[5:]
        return out

    @staticmethod
    @once_differentiable  # kernels, not torch ops: create_graph=True raises, never a silent zero
    def backward(ctx, grad_out):
        x, w13, w2, topk_weights, sorted_ids, expert_ids, act, h13, y = ctx.saved_tensors
        k, block_m, _ = ctx.meta
        dx, dw13, dw2, grad_w = _backward(grad_out, x, w13, w2, topk_weights, sorted_ids, expert_ids, act, h13, y, k,
                                          block_m)
        return dx, dw13, dw2, grad_w, None, None


def _backward(grad_out, x, w13, w2, topk_weights, sorted_ids, expert_ids, act, h13, y, k: int, block_m: int):
    """Gradients (dx, dw13, dw2, d topk_weights) of `_forward(save=True)` from what it saved; float32 math."""
    t, num_slots = x.shape[0], x.shape[0] * k
    g = grad_out.float()
    grad_w = (y.float().view(t, k, -1) * g.view(t, 1, -1)).sum(-1).to(topk_weights.dtype)
    dy = (g.view(t, 1, -1) * topk_weights.float().view(t, k, 1)).reshape(num_slots, -1).to(x.dtype)
    w2_t = w2.transpose(1, 2)  # [E, I, H]: d act = dy @ w2[e]
    d_act = grouped_gemm(dy, w2_t, sorted_ids, expert_ids, num_slots, a_div=1, block_m=block_m)[0]
    gate, up = h13.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    d_gate = d_act.float() * up * sig * (1 + gate * (1 - sig))
    d_h13 = torch.cat([d_gate, d_act.float() * F.silu(gate)], dim=-1).to(x.dtype)
    w13_t = w13.transpose(1, 2)  # [E, H, 2I]: dx slot = d_h13 @ w13[e]
    dx_slots = grouped_gemm(d_h13, w13_t, sorted_ids, expert_ids, num_slots, a_div=1, block_m=block_m)[0]
    dx = dx_slots.float().view(t, k, -1).sum(1).to(x.dtype)
    dw13, dw2 = _weight_grads(x, dy, act, d_h13, sorted_ids, expert_ids, k, block_m, w13.shape[0])
    return dx, dw13.to(w13.dtype), dw2.to(w2.dtype), grad_w


def _weight_grads(x, dy, act, d_h13, sorted_ids, expert_ids, k, block_m, num_experts):
    """dW13[e] = d_h13[slots of e]^T x[tokens of e]; dW2[e] = dy[slots]^T act[slots] (float32 accumulate).

    One matmul pair per expert over its run of sorted slots (one host sync for the run lengths).
    """
    num_slots = dy.shape[0]
    dw13 = torch.zeros((num_experts, d_h13.shape[1], x.shape[1]), dtype=torch.float32, device=x.device)
    dw2 = torch.zeros((num_experts, dy.shape[1], act.shape[1]), dtype=torch.float32, device=x.device)
    block_expert = expert_ids.repeat_interleave(block_m)[: sorted_ids.numel()]
    valid = (sorted_ids < num_slots) & (block_expert >= 0)
    slots, experts = sorted_ids[valid], block_expert[valid]
    counts = torch.bincount(experts, minlength=num_experts).tolist()
    for e, part in enumerate(slots.split(counts)):
        if part.numel():
            dw13[e] = d_h13[part].float().t() @ x[part // k].float()
            dw2[e] = dy[part].float().t() @ act[part].float()
    return dw13, dw2


# torch.compile: the Triton paths as opaque custom ops. The training op returns what the eager Function saves
# (act, h13 and y, one row per (token, expert) slot); its backward recomputes the alignment from topk_ids (cheap,
# and deterministic: the same block size for the same token count) rather than passing index tensors through.

@torch.library.custom_op("fxrewrite::fused_experts", mutates_args=())
def _experts_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, expert_start: int) -> torch.Tensor:
    return _fused_experts_eager(x, w13, w2, topk_weights, topk_ids, expert_start)


@_experts_op.register_fake
def _(x, w13, w2, topk_weights, topk_ids, expert_start):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("fxrewrite::fused_experts_train", mutates_args=())
def _train_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_start: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if x.shape[0] == 0:
        return _train_fake(x, w13, w2, topk_weights, topk_ids, expert_start)
    out, saved = _forward(x, w13, w2, topk_weights, topk_ids, expert_start, save=True)
    return (out, *saved[2:5])


@_train_op.register_fake
def _train_fake(x, w13, w2, topk_weights, topk_ids, expert_start):
    slots, i = topk_ids.numel(), w2.shape[2]
    return (torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(slots, i),
            x.new_empty(slots, 2 * i), x.new_empty(slots, x.shape[1]))


@torch.library.custom_op("fxrewrite::fused_experts_train_backward", mutates_args=())
def _train_backward_op(grad_out: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor, act: torch.Tensor, h13: torch.Tensor,
                       y: torch.Tensor, expert_start: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if x.shape[0] == 0:
        return _train_backward_fake(grad_out, x, w13, w2, topk_weights, topk_ids, act, h13, y, expert_start)
    block_m = gemm_config(x.shape[0])["block_m"]  # _forward's
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, block_m, w13.shape[0], expert_start)
    return _backward(grad_out, x, w13, w2, topk_weights, sorted_ids, expert_ids, act, h13, y, topk_ids.shape[1],
                     block_m)


@_train_backward_op.register_fake
def _train_backward_fake(grad_out, x, w13, w2, topk_weights, topk_ids, act, h13, y, expert_start):
    fresh = torch.contiguous_format
    return (torch.zeros_like(x, memory_format=fresh), torch.zeros_like(w13, memory_format=fresh),
            torch.zeros_like(w2, memory_format=fresh), torch.zeros_like(topk_weights, memory_format=fresh))


def _train_setup(ctx, inputs, output):
    x, w13, w2, topk_weights, topk_ids, expert_start = inputs
    ctx.save_for_backward(x, w13, w2, topk_weights, topk_ids, *output[1:])
    ctx.expert_start = expert_start
    ctx.mark_non_differentiable(*output[1:])


def _train_backward(ctx, grad_out, *_saved_grads):
    grads = torch.ops.fxrewrite.fused_experts_train_backward(grad_out, *ctx.saved_tensors, ctx.expert_start)
    return (*(g if want else None for g, want in zip(grads, ctx.needs_input_grad[:4])), None, None)


_train_op.register_autograd(_train_backward, setup_context=_train_setup)
