"""Qwen3's q/k-norm + rotary for training, one Triton kernel each way, on transformers' layout.

Forward (transformers ``Qwen3Attention``): per head, the Llama RMSNorm ``y = w * (x * rstd).to(dtype)``,
``rstd = rsqrt(mean(x², -1) + eps)`` in float32, then rotary on the first ``rotary_dim`` features (neox halves
or GPT-J pairs: ``o1 = c1 y1 - s1 y2``, ``o2 = c2 y2 + s2 y1``), rounded once to the dtype, as the unfused training
path (:func:`fxrewrite.kernels.rms_norm_backward.rms_norm_train` then
:func:`fxrewrite.kernels.rotary_backward.rotary_apply_train`). q and k are read with any strides (the
``view(...).transpose(1, 2)`` of a fused QKV output slice) and written as new tensors.
Saved for the backward: only the inputs q and k (views; the QKV output they belong to is what SDPA's saved v
keeps alive anyway) and cos/sin; rstd is recomputed from x, which the backward reads regardless.
Backward: the rotary is linear, its transpose is ``g1 = c1 do1 + s2 do2``, ``g2 = c2 do2 - s1 do1``; then the
RMSNorm backward with ``g' = g * w``: ``dx = rstd (g' - x̂ mean(g' x̂))``, ``dw = sum_tokens(g x̂.to(dtype))``.
Against the unfused pair this drops, per layer and direction, the contiguous copies of the strided q/k views,
of the rotary's gradient and of dx, and two of three launches. Reference: autograd through
:func:`qk_norm_rope_train_ref`.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from fxrewrite.kernels import use_triton
from fxrewrite.kernels.rms_norm import rms_norm_ref
from fxrewrite.kernels.rotary import pair_offsets
from fxrewrite.kernels.rotary_backward import _rotate_ref, rotary_apply_ref
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["qk_norm_rope_train", "qk_norm_rope_train_ref", "QKNormRopeFunction"]

_TOKENS_PER_PROGRAM = 8  # backward, CUDA: 2048 programs at 8 x 2048 tokens, dw partials 1 MiB float32


def qk_norm_rope_train_ref(q, k, cos, sin, q_weight, k_weight, q_eps: float, k_eps: float, is_neox_style: bool = True):
    """Torch reference: q [B, Hq, S, D], k [B, Hk, S, D], cos/sin [B or 1, S, rotary_dim], weights [D] -> (q, k)."""
    return rotary_apply_ref(rms_norm_ref(q, q_weight, q_eps), rms_norm_ref(k, k_weight, k_eps), cos, sin,
                            is_neox_style)


@triton.jit
def _heads_tile(base, hs, n_heads, o1, o2, im, BLOCK_H: tl.constexpr, BLOCK_PASS: tl.constexpr,
                HALF: tl.constexpr, PASS: tl.constexpr):
    """Pointers [BLOCK_H, BLOCK_HALF] x2 and [BLOCK_H, BLOCK_PASS] of one token's heads, with their masks."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    hm = heads < n_heads
    rows = base + heads * hs
    j = tl.arange(0, BLOCK_PASS)[None, :]
    return rows + o1[None, :], rows + o2[None, :], rows + 2 * HALF + j, hm & im[None, :], hm & (j < PASS)


@triton.jit
def _load_heads_rstd(x_base, xs_h, n_heads, o1, o2, im, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                     PASS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_PASS: tl.constexpr):
    """One token's heads in float32 (pair halves x1, x2, pass-through xp), their masks and 1/rms per head."""
    p1, p2, pp, m, mp = _heads_tile(x_base, xs_h, n_heads, o1, o2, im, BLOCK_H, BLOCK_PASS, HALF, PASS)
    x1 = tl.load(p1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=m, other=0.0).to(tl.float32)
    xp = tl.load(pp, mask=mp, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + tl.sum(xp * xp, 1)) / HEAD_DIM + eps)[:, None]
    return x1, x2, xp, rstd, m, mp


@triton.jit
def _fwd_heads(x_base, xs_h, o_base, os_h, n_heads, w_ptr, c1, c2, s1, s2, eps, o1, o2, im,
               HEAD_DIM: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_PASS: tl.constexpr):
    x1, x2, xp, rstd, m, mp = _load_heads_rstd(x_base, xs_h, n_heads, o1, o2, im, eps, HEAD_DIM, HALF, PASS,
                                               BLOCK_H, BLOCK_PASS)
    dtype = x_base.dtype.element_ty
    jp = 2 * HALF + tl.arange(0, BLOCK_PASS)
    y1 = ((x1 * rstd).to(dtype).to(tl.float32) * tl.load(w_ptr + o1, mask=im, other=0.0).to(tl.float32)[None, :])
    y2 = ((x2 * rstd).to(dtype).to(tl.float32) * tl.load(w_ptr + o2, mask=im, other=0.0).to(tl.float32)[None, :])
    yp = (xp * rstd).to(dtype).to(tl.float32) * tl.load(w_ptr + jp, mask=jp < HEAD_DIM, other=0.0).to(tl.float32)
    y1 = y1.to(dtype).to(tl.float32)  # the norm's output is a tensor of the input dtype in the unfused form
    y2 = y2.to(dtype).to(tl.float32)
    q1, q2, qp, _, _ = _heads_tile(o_base, os_h, n_heads, o1, o2, im, BLOCK_H, BLOCK_PASS, HALF, PASS)
    tl.store(q1, (c1 * y1 - s1 * y2).to(dtype), mask=m)
    tl.store(q2, (c2 * y2 + s2 * y1).to(dtype), mask=m)
    tl.store(qp, yp.to(dtype), mask=mp)


@triton.jit
def _bwd_heads(x_base, xs_h, d_base, ds_h, g_base, gs_h, n_heads, w_ptr, c1, c2, s1, s2, eps, o1, o2, im,
               HEAD_DIM: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_PASS: tl.constexpr):
    """One token's heads: store dx at g_base; return this token's dw terms (pair halves, pass-through)."""
    x1, x2, xp, rstd, m, mp = _load_heads_rstd(x_base, xs_h, n_heads, o1, o2, im, eps, HEAD_DIM, HALF, PASS,
                                               BLOCK_H, BLOCK_PASS)
    e1, e2, ep, _, _ = _heads_tile(d_base, ds_h, n_heads, o1, o2, im, BLOCK_H, BLOCK_PASS, HALF, PASS)
    do1 = tl.load(e1, mask=m, other=0.0).to(tl.float32)
    do2 = tl.load(e2, mask=m, other=0.0).to(tl.float32)
    gp = tl.load(ep, mask=mp, other=0.0).to(tl.float32)
    g1 = c1 * do1 + s2 * do2  # the rotary's transpose
    g2 = c2 * do2 - s1 * do1
    jp = 2 * HALF + tl.arange(0, BLOCK_PASS)
    w1 = tl.load(w_ptr + o1, mask=im, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + o2, mask=im, other=0.0).to(tl.float32)[None, :]
    wp = tl.load(w_ptr + jp, mask=jp < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
    h1, h2, hp = x1 * rstd, x2 * rstd, xp * rstd
    dot = (tl.sum(g1 * w1 * h1, 1) + tl.sum(g2 * w2 * h2, 1) + tl.sum(gp * wp * hp, 1))[:, None] / HEAD_DIM
    dtype = g_base.dtype.element_ty
    r1, r2, rp, _, _ = _heads_tile(g_base, gs_h, n_heads, o1, o2, im, BLOCK_H, BLOCK_PASS, HALF, PASS)
    tl.store(r1, (rstd * (g1 * w1 - h1 * dot)).to(dtype), mask=m)
    tl.store(r2, (rstd * (g2 * w2 - h2 * dot)).to(dtype), mask=m)
    tl.store(rp, (rstd * (gp * wp - hp * dot)).to(dtype), mask=mp)
    xdt = x_base.dtype.element_ty  # Llama multiplies the weight by x̂ rounded to the input dtype
    return (tl.sum(g1 * h1.to(xdt).to(tl.float32), 0), tl.sum(g2 * h2.to(xdt).to(tl.float32), 0),
            tl.sum(gp * hp.to(xdt).to(tl.float32), 0))


@triton.jit
def _token_cos_sin(cos_ptr, sin_ptr, tok, S, cs_b, cs_s, o1, o2, im):
    b = tok // S
    s = tok % S
    cb = b * cs_b + s * cs_s
    c1 = tl.load(cos_ptr + cb + o1, mask=im, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + cb + o2, mask=im, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + cb + o1, mask=im, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + cb + o2, mask=im, other=0.0).to(tl.float32)[None, :]
    return b, s, c1, c2, s1, s2


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, S, qs_b, qs_h, qs_s, ks_b, ks_h,
                ks_s, qos_b, qos_h, qos_s, kos_b, kos_h, kos_s, cs_b, cs_s, n_q, n_k, q_eps, k_eps,
                HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PASS: tl.constexpr,
                BLOCK_PASS: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, IS_NEOX: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    im = i < HALF
    o1, o2 = pair_offsets(i, HALF, IS_NEOX)
    b, s, c1, c2, s1, s2 = _token_cos_sin(cos_ptr, sin_ptr, tok, S, cs_b, cs_s, o1, o2, im)
    _fwd_heads(q_ptr + b * qs_b + s * qs_s, qs_h, qo_ptr + b * qos_b + s * qos_s, qos_h, n_q, qw_ptr,
               c1, c2, s1, s2, q_eps, o1, o2, im, HEAD_DIM, HALF, PASS, BLOCK_HQ, BLOCK_PASS)
    _fwd_heads(k_ptr + b * ks_b + s * ks_s, ks_h, ko_ptr + b * kos_b + s * kos_s, kos_h, n_k, kw_ptr,
               c1, c2, s1, s2, k_eps, o1, o2, im, HEAD_DIM, HALF, PASS, BLOCK_HK, BLOCK_PASS)


@triton.jit
def _bwd_one(x_ptr, xs_b, xs_h, xs_s, d_ptr, ds_b, ds_h, ds_s, g_ptr, gs_b, gs_h, gs_s, dw_ptr, pid, n_heads, w_ptr, cos_ptr, sin_ptr, S, cs_b, cs_s,
             eps, start, n_tok, rows_per_program, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
             BLOCK_HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_H: tl.constexpr,
             IS_NEOX: tl.constexpr):
    """One of q / k over this program's tokens (x: the input, d: the output's gradient, g: dx)."""
    i = tl.arange(0, BLOCK_HALF)
    im = i < HALF
    o1, o2 = pair_offsets(i, HALF, IS_NEOX)
    dw1 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    dw2 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    dwp = tl.zeros([BLOCK_PASS], dtype=tl.float32)
    for r in range(0, rows_per_program):
        tok = tl.minimum(start + r, n_tok - 1)
        heads = tl.where(start + r < n_tok, n_heads, 0)  # rows past the end: every lane masked, dw += 0
        b, s, c1, c2, s1, s2 = _token_cos_sin(cos_ptr, sin_ptr, tok, S, cs_b, cs_s, o1, o2, im)
        a1, a2, ap = _bwd_heads(x_ptr + b * xs_b + s * xs_s, xs_h, d_ptr + b * ds_b + s * ds_s, ds_h,
                                g_ptr + b * gs_b + s * gs_s, gs_h, heads, w_ptr, c1, c2, s1, s2, eps, o1, o2,
                                im, HEAD_DIM, HALF, PASS, BLOCK_H, BLOCK_PASS)
        dw1 += a1
        dw2 += a2
        dwp += ap
    row = dw_ptr + pid * HEAD_DIM
    tl.store(row + o1, dw1, mask=im)
    tl.store(row + o2, dw2, mask=im)
    jp = tl.arange(0, BLOCK_PASS)
    tl.store(row + 2 * HALF + jp, dwp, mask=jp < PASS)


@triton.jit
def _bwd_kernel(q_ptr, k_ptr, dq_ptr, dk_ptr, gq_ptr, gk_ptr, dwq_ptr, dwk_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr,
                S, qs_b, qs_h, qs_s, ks_b, ks_h, ks_s, dqs_b, dqs_h, dqs_s, dks_b, dks_h, dks_s, gqs_b, gqs_h,
                gqs_s, gks_b, gks_h, gks_s, cs_b, cs_s, n_q, n_k, q_eps, k_eps, n_tok, rows_per_program,
                HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PASS: tl.constexpr,
                BLOCK_PASS: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, IS_NEOX: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * rows_per_program
    _bwd_one(q_ptr, qs_b, qs_h, qs_s, dq_ptr, dqs_b, dqs_h, dqs_s, gq_ptr, gqs_b, gqs_h, gqs_s, dwq_ptr, pid,
             n_q, qw_ptr, cos_ptr, sin_ptr, S, cs_b, cs_s, q_eps, start, n_tok, rows_per_program, HEAD_DIM, HALF,
             BLOCK_HALF, PASS, BLOCK_PASS, BLOCK_HQ, IS_NEOX)
    _bwd_one(k_ptr, ks_b, ks_h, ks_s, dk_ptr, dks_b, dks_h, dks_s, gk_ptr, gks_b, gks_h, gks_s, dwk_ptr, pid,
             n_k, kw_ptr, cos_ptr, sin_ptr, S, cs_b, cs_s, k_eps, start, n_tok, rows_per_program, HEAD_DIM, HALF,
             BLOCK_HALF, PASS, BLOCK_PASS, BLOCK_HK, IS_NEOX)


def _bshd(x: torch.Tensor) -> torch.Tensor:
    """A new [B, H, S, D] tensor laid out as [B, S, H, D] (what SDPA and the QKV split's backward read best)."""
    B, H, S, D = x.shape
    return torch.empty((B, S, H, D), dtype=x.dtype, device=x.device).transpose(1, 2)


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _consts(q, k, cos, is_neox_style) -> dict:
    D, rd = q.shape[-1], cos.shape[-1]
    return dict(HEAD_DIM=D, HALF=rd // 2, BLOCK_HALF=next_power_of_2(rd // 2), PASS=D - rd,
                BLOCK_PASS=next_power_of_2(max(D - rd, 1)), BLOCK_HQ=next_power_of_2(q.shape[1]),
                BLOCK_HK=next_power_of_2(k.shape[1]), IS_NEOX=is_neox_style, num_warps=4)


def qk_forward(q, k, cos, sin, q_weight, k_weight, q_eps: float, k_eps: float, is_neox_style: bool):
    """Triton forward: (q_out, k_out), new [B, H, S, D] tensors laid out as [B, S, H, D] (:func:`_bshd`)."""
    cos, sin = cos.contiguous(), sin.contiguous()
    qo, ko = _bshd(q), _bshd(k)
    B, _, S, _ = q.shape
    cs_b = cos.stride(0) if cos.shape[0] > 1 else 0
    if q.numel():
        launch(_fwd_kernel, (B * S,), q.device)(
            q, k, qo, ko, q_weight, k_weight, cos, sin, S, *_strides(q), *_strides(k), *_strides(qo),
            *_strides(ko), cs_b, cos.stride(1), q.shape[1], k.shape[1], float(q_eps), float(k_eps),
            **_consts(q, k, cos, is_neox_style))
    return qo, ko


def qk_backward(dq, dk, q, k, cos, sin, q_weight, k_weight, q_eps: float, k_eps: float, is_neox_style: bool):
    """Triton backward from the saved inputs: (dq, dk like :func:`_bshd`, dq_weight, dk_weight float32 [D]);
    a None incoming gradient counts as zeros."""
    cos, sin = cos.contiguous(), sin.contiguous()
    dq = torch.zeros_like(q) if dq is None else dq
    dk = torch.zeros_like(k) if dk is None else dk
    dq, dk = (d if d.stride(-1) == 1 else d.contiguous() for d in (dq, dk))
    gq, gk = _bshd(q), _bshd(k)
    B, _, S, D = q.shape
    n_tok = B * S
    # dw's partial sums are only [programs, D]: many short programs hide the loads' latency (the interpreter:
    # few long ones, fast tests)
    per = _TOKENS_PER_PROGRAM if q.is_cuda else max(1, -(-n_tok // max(1, min(n_tok, 4))))
    programs = max(1, -(-n_tok // per))
    new = torch.empty if n_tok else torch.zeros  # every program writes its whole dw rows: no zero fill
    dwq = new(programs, D, dtype=torch.float32, device=q.device)
    dwk = new(programs, D, dtype=torch.float32, device=q.device)
    cs_b = cos.stride(0) if cos.shape[0] > 1 else 0
    if n_tok:
        launch(_bwd_kernel, (programs,), q.device)(
            q, k, dq, dk, gq, gk, dwq, dwk, q_weight, k_weight, cos, sin, S, *_strides(q), *_strides(k),
            *_strides(dq), *_strides(dk), *_strides(gq), *_strides(gk), cs_b, cos.stride(1), q.shape[1],
            k.shape[1], float(q_eps), float(k_eps), n_tok, per, **_consts(q, k, cos, is_neox_style))
    return gq, gk, dwq.sum(0), dwk.sum(0)


class QKNormRopeFunction(torch.autograd.Function):
    """``apply(q, k, cos, sin, q_weight, k_weight, q_eps, k_eps, is_neox_style) -> (q_out, k_out)``."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, q_weight, k_weight, q_eps, k_eps, is_neox_style):
        qo, ko = qk_forward(q, k, cos, sin, q_weight, k_weight, q_eps, k_eps, is_neox_style)
        ctx.save_for_backward(q, k, cos, sin, q_weight, k_weight)
        ctx.eps, ctx.is_neox_style = (float(q_eps), float(k_eps)), is_neox_style
        return qo, ko

    @staticmethod
    @once_differentiable  # kernels, not torch ops: create_graph=True raises, never a silent zero
    def backward(ctx, dq, dk):
        q, k, cos, sin, q_weight, k_weight = ctx.saved_tensors
        gq, gk, dwq, dwk = qk_backward(dq, dk, q, k, cos, sin, q_weight, k_weight, *ctx.eps, ctx.is_neox_style)
        dwq = dwq.to(q_weight.dtype) if ctx.needs_input_grad[4] else None
        dwk = dwk.to(k_weight.dtype) if ctx.needs_input_grad[5] else None
        return gq, gk, None, None, dwq, dwk, None, None, None


def fits(q, k, cos, sin, q_weight, k_weight, unsqueeze_dim: int = 1) -> bool:
    """Whether the fused kernel takes these: transformers' layout, contiguous head dims, one dtype for q, k and
    both weights (the output dtype is then q's, as in the unfused form), cos/sin without gradient."""
    if unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    D, rd = q.shape[-1], cos.shape[-1]
    return (rd % 2 == 0 and rd <= D and k.shape[-1] == D and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
            == cos.shape[1] and cos.shape[0] in (1, q.shape[0]) and q.stride(-1) == 1 and k.stride(-1) == 1
            and q.dtype == k.dtype == q_weight.dtype == k_weight.dtype and q_weight.shape == k_weight.shape == (D,)
            and not (cos.requires_grad or sin.requires_grad))


def qk_norm_rope_train(q, k, cos, sin, q_weight, k_weight, q_eps: float, k_eps: float, unsqueeze_dim: int = 1,
                       is_neox_style: bool = True):
    """Differentiable per-head q/k RMSNorm + rotary; returns new (q, k) of the input shapes and q's dtype.

    :class:`QKNormRopeFunction` where :func:`fxrewrite.kernels.use_triton` says so and :func:`fits`, else
    autograd through :func:`qk_norm_rope_train_ref` (cos/sin unsqueezed at ``unsqueeze_dim``).
    """
    if use_triton(q) and fits(q, k, cos, sin, q_weight, k_weight, unsqueeze_dim):
        return QKNormRopeFunction.apply(q, k, cos, sin, q_weight, k_weight, q_eps, k_eps, is_neox_style)
    q, k = rms_norm_ref(q, q_weight, q_eps), rms_norm_ref(k, k_weight, k_eps)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _rotate_ref(q, cos, sin, is_neox_style), _rotate_ref(k, cos, sin, is_neox_style)
