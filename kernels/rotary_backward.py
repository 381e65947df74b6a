"""Rotary on transformers' layout for training: q [B, Hq, S, D], k [B, Hk, S, D], cos/sin [B or 1, S, rotary_dim].

Formula (transformers ``apply_rotary_pos_emb``): ``x * cos + rotate(x) * sin`` on the first ``rotary_dim``
features, the rest passed through. With (x1, x2) the two halves (neox) or the even/odd features (GPT-J)
and (c1, c2), (s1, s2) the matching parts of cos and sin: ``y1 = c1 x1 - s1 x2``, ``y2 = c2 x2 + s2 x1``.
The map is linear in x, so the backward is its transpose, ``dx1 = c1 dy1 + s2 dy2``, ``dx2 = c2 dy2 - s1 dy1``:
the same kernel with other coefficients, and nothing is saved but cos and sin (already alive).
The kernel reads any strides but the features' (the usual ``view(...).transpose(1, 2)`` q; a gradient arriving
feature-strided is copied first), writes new contiguous tensors,
and computes in float32 with one rounding where transformers rounds each product in the input dtype.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from fxrewrite.kernels import use_triton
from fxrewrite.kernels.rotary import pair_offsets
from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["rotary_apply_ref", "rotary_apply_train", "RotaryApplyFunction"]


def _rotate_ref(x, cos, sin, is_neox_style):
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    if is_neox_style:
        rot = torch.cat((-x_rot[..., rd // 2:], x_rot[..., : rd // 2]), dim=-1)
    else:
        rot = torch.stack((-x_rot[..., 1::2], x_rot[..., 0::2]), dim=-1).flatten(-2)
    out = x_rot * cos + rot * sin
    return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)


def rotary_apply_ref(q, k, cos, sin, is_neox_style: bool = True):
    """Torch reference: q [B, Hq, S, D], k [B, Hk, S, D], cos/sin [B or 1, S, rotary_dim] -> (q, k), input dtypes."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return _rotate_ref(q, cos, sin, is_neox_style), _rotate_ref(k, cos, sin, is_neox_style)


@triton.jit
def _rotary_bhsd_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, S, xs_b, xs_h, xs_s, os_b, os_h, os_s, cs_b, cs_s,
                        n_heads, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PASS: tl.constexpr,
                        BLOCK_PASS: tl.constexpr, BLOCK_H: tl.constexpr, IS_NEOX: tl.constexpr,
                        BACKWARD: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // S
    s = pid % S
    i = tl.arange(0, BLOCK_HALF)
    im = i < HALF
    o1, o2 = pair_offsets(i, HALF, IS_NEOX)
    cb = b * cs_b + s * cs_s
    c1 = tl.load(cos_ptr + cb + o1, mask=im, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + cb + o2, mask=im, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + cb + o1, mask=im, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + cb + o2, mask=im, other=0.0).to(tl.float32)[None, :]
    heads = tl.arange(0, BLOCK_H)
    hm = heads < n_heads
    xb = x_ptr + b * xs_b + s * xs_s + heads[:, None] * xs_h
    ob = out_ptr + b * os_b + s * os_s + heads[:, None] * os_h
    m = hm[:, None] & im[None, :]
    x1 = tl.load(xb + o1[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xb + o2[None, :], mask=m, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = c1 * x1 + s2 * x2
        y2 = c2 * x2 - s1 * x1
    else:
        y1 = c1 * x1 - s1 * x2
        y2 = c2 * x2 + s2 * x1
    tl.store(ob + o1[None, :], y1.to(out_ptr.dtype.element_ty), mask=m)
    tl.store(ob + o2[None, :], y2.to(out_ptr.dtype.element_ty), mask=m)
    if PASS > 0:
        j = tl.arange(0, BLOCK_PASS)
        mp = hm[:, None] & (j < PASS)[None, :]
        xp = tl.load(xb + 2 * HALF + j[None, :], mask=mp, other=0.0)
        tl.store(ob + 2 * HALF + j[None, :], xp, mask=mp)


def _launch(x, cos, sin, is_neox_style, backward):
    B, H, S, D = x.shape
    rd = cos.shape[-1]
    out = torch.empty((B, S, H, D), dtype=x.dtype, device=x.device).transpose(1, 2)
    cb = cos.stride(0) if cos.shape[0] > 1 else 0
    if x.numel():
        launch(_rotary_bhsd_kernel, (B * S,), x.device)(
            x, out, cos, sin, S, x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
            cb, cos.stride(1), H, HALF=rd // 2, BLOCK_HALF=next_power_of_2(rd // 2), PASS=D - rd,
            BLOCK_PASS=next_power_of_2(max(D - rd, 1)), BLOCK_H=next_power_of_2(H), IS_NEOX=is_neox_style,
            BACKWARD=backward, num_warps=4)
    return out


class RotaryApplyFunction(torch.autograd.Function):
    """``apply(q, k, cos, sin, is_neox_style) -> (q_out, k_out)``; cos/sin get no gradient."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, is_neox_style):
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        ctx.is_neox_style = is_neox_style
        return _launch(q, cos, sin, is_neox_style, False), _launch(k, cos, sin, is_neox_style, False)

    @staticmethod
    @once_differentiable  # kernels, not torch ops: create_graph=True raises, never a silent zero
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        # the kernel reads features at unit stride; eager attention's ``q @ k.transpose(2, 3)`` hands back dk (and an
        # MHA layer's dq) feature-strided
        dq, dk = (d if d is None or d.stride(-1) == 1 else d.contiguous() for d in (dq, dk))
        dq = _launch(dq, cos, sin, ctx.is_neox_style, True) if dq is not None else None
        dk = _launch(dk, cos, sin, ctx.is_neox_style, True) if dk is not None else None
        return dq, dk, None, None, None


def _kernel_fits(q, k, cos, sin, unsqueeze_dim) -> bool:
    if unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    rd = cos.shape[-1]
    return (rd % 2 == 0 and rd <= q.shape[-1] and q.shape[-1] == k.shape[-1] and q.shape[0] == k.shape[0]
            and q.shape[2] == k.shape[2] == cos.shape[1] and cos.shape[0] in (1, q.shape[0])
            and q.stride(-1) == 1 and k.stride(-1) == 1 and k.dtype == q.dtype
            and not (cos.requires_grad or sin.requires_grad))


def rotary_apply_train(q, k, cos, sin, unsqueeze_dim: int = 1, is_neox_style: bool = True):
    """Differentiable rotary on (q, k) in transformers' layout; returns new (q, k) of the input shapes.

    The Triton forward/backward (:class:`RotaryApplyFunction`) runs where :func:`fxrewrite.kernels.use_triton`
    says so and the layout is the usual one (unsqueeze_dim 1, contiguous head dim, cos without gradient);
    anything else is autograd through :func:`rotary_apply_ref`.
    """
    if use_triton(q) and _kernel_fits(q, k, cos, sin, unsqueeze_dim):
        return RotaryApplyFunction.apply(q, k, cos, sin, is_neox_style)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _rotate_ref(q, cos, sin, is_neox_style), _rotate_ref(k, cos, sin, is_neox_style)
