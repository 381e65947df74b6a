"""Cross-entropy loss and its logits gradient in one pass over a [rows, vocab] block, written in place.

For each row with target t (rows whose target is ``ignore_index`` give loss 0 and gradient 0):
``y = softcap * tanh(scale * z / softcap)`` (or ``y = scale * z`` without soft-capping: Gemma 2's
``final_logit_softcapping``, Granite's ``1 / logits_scaling``, Cohere's ``logit_scale``),
``loss = logsumexp(y) - y[t]`` and ``dloss/dz = (softmax(y) - onehot(t)) * dy/dz`` with
``dy/dz = scale * (1 - tanh²)`` (soft-capped) or ``scale``. The row is read twice (an online max /
sum-of-exponentials pass, then the gradient pass) and the gradient overwrites the logits, so no
float32 copy of the block is made. Liger-Kernel's cross-entropy kernel works the same way; the
softmax-gradient identity is the standard one (e.g. Bishop, PRML, eq. 4.109).
The reference :func:`cross_entropy_grad_ref` is autograd through ``F.cross_entropy`` in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxrewrite.kernels.triton_utils import launch, next_power_of_2, tl, triton

__all__ = ["check_targets", "cross_entropy_grad_", "cross_entropy_grad_ref", "cross_entropy_grad_torch"]


def _transform(z: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    y = z.float() * scale
    return softcap * torch.tanh(y / softcap) if softcap else y


def cross_entropy_grad_ref(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                           scale: float = 1.0, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: logits [R, V] (any float dtype), target int64 [R] -> (summed loss float32 [],
    gradient of that sum w.r.t. logits [R, V] in the logits' dtype)."""
    z = logits.detach().float().requires_grad_()
    loss = F.cross_entropy(_transform(z, scale, softcap), target, ignore_index=ignore_index, reduction="sum")
    (grad,) = torch.autograd.grad(loss, z)
    return loss.detach(), grad.to(logits.dtype)


def cross_entropy_grad_torch(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                             scale: float = 1.0, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's closed form in torch, without autograd (usable inside a custom op, where autograd is
    off): same contract and values as :func:`cross_entropy_grad_ref`, float32 math; a target outside the vocabulary
    fails as in the kernel (`check_targets`), not as an out-of-bounds gather."""
    check_targets(target, logits.shape[-1], ignore_index)
    y = _transform(logits, scale, softcap)
    keep = target != ignore_index
    t = torch.where(keep, target, 0)
    lse = torch.logsumexp(y, dim=-1)
    loss = ((lse - y.gather(-1, t[:, None])[:, 0]) * keep).sum()
    grad = torch.softmax(y, dim=-1)
    grad[torch.arange(grad.shape[0], device=grad.device), t] -= 1.0
    dydz = scale * (1.0 - (y / softcap) ** 2) if softcap else scale
    return loss, (grad * dydz * keep[:, None]).to(logits.dtype)


def check_targets(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Every target in [0, vocab) or ``ignore_index``: the kernel reads the logit at the target's column, so another
    value would read outside its row. On a GPU checked without a host sync (``torch._assert_async``: a device-side
    assert, as transformers' own loss gives); on a CPU, where reading the flag costs nothing, an IndexError, the
    exception torch's cross_entropy raises there."""
    ok = ((target >= 0) & (target < vocab)) | (target == ignore_index)
    message = (f"cross-entropy: a target is outside [0, {vocab}) and is not ignore_index={ignore_index} (labels from "
               "another vocabulary?)")
    if target.device.type == "cpu":
        if not bool(ok.all()):
            raise IndexError(message)
        return
    torch._assert_async(ok.all(), message)


@triton.jit
def _scaled(z, scale, softcap, SOFTCAP: tl.constexpr):
    y = z * scale
    if SOFTCAP:
        y = softcap * (2.0 * tl.sigmoid(2.0 * y / softcap) - 1.0)  # tanh via sigmoid (every triton version)
    return y


@triton.jit
def _ce_kernel(z_ptr, target_ptr, loss_ptr, row_scale_ptr, stride, V, ignore_index, scale, softcap,
               SOFTCAP: tl.constexpr, ROW_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride
    t = tl.load(target_ptr + row)
    keep = (t != ignore_index).to(tl.float32)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    d = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        y = _scaled(tl.load(base + cols, mask=mask, other=0.0).to(tl.float32), scale, softcap, SOFTCAP)
        y = tl.where(mask, y, float("-inf"))
        m_new = tl.maximum(m, y)
        ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # lanes without a logit yet keep d = 0, not NaN
        d = d * tl.exp(m - ref) + tl.exp(y - ref)
        m = m_new
    mx = tl.max(m, 0)
    lse = mx + tl.log(tl.sum(d * tl.exp(m - mx), 0))
    t_safe = tl.where(t == ignore_index, 0, t)
    yt = _scaled(tl.load(base + t_safe).to(tl.float32), scale, softcap, SOFTCAP)
    tl.store(loss_ptr + row, (lse - yt) * keep)
    if ROW_SCALE:  # the row's incoming gradient, applied in float32 before the one rounding to z's dtype
        keep = keep * tl.load(row_scale_ptr + row).to(tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        y = _scaled(z, scale, softcap, SOFTCAP)
        g = tl.exp(y - lse) - (cols == t).to(tl.float32)
        if SOFTCAP:
            th = y / softcap
            g = g * scale * (1.0 - th * th)
        else:
            g = g * scale
        tl.store(base + cols, (g * keep).to(z_ptr.dtype.element_ty), mask=mask)


def cross_entropy_grad_(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                        scale: float = 1.0, softcap: float | None = None, losses: torch.Tensor | None = None,
                        row_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """Triton, in place: logits [R, V] (row-contiguous) become d(sum of losses)/d(logits); returns the
    summed loss (float32 []) over rows whose target is not ``ignore_index``. Same values as
    :func:`cross_entropy_grad_ref`. With ``losses`` (float32 [R], contiguous) the per-row losses are written
    there instead and None is returned (the fused linear cross-entropy sums all chunks' rows once, at the
    end: no allocation and no reduction per chunk). ``row_scale`` (float32 [R]): each row's gradient is
    multiplied by it in float32 before it is written (a per-token weighted backward, as in
    :mod:`fxrewrite.kernels.fused_linear_logprobs`). ValueError on mismatched shapes or a non-contiguous row."""
    if logits.dim() != 2 or target.shape != logits.shape[:1] or logits.stride(1) != 1:
        raise ValueError(f"cross_entropy_grad_: logits {tuple(logits.shape)} must be [R, V] with contiguous rows "
                         f"and target {tuple(target.shape)} [R]")
    rows, vocab = logits.shape
    out = losses
    if out is None:
        out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    elif out.shape != (rows,) or out.dtype != torch.float32 or out.stride(0) != 1:
        raise ValueError(f"cross_entropy_grad_: losses {tuple(out.shape)} {out.dtype} must be float32 [{rows}]")
    if row_scale is not None and (row_scale.shape != (rows,) or row_scale.stride(0) != 1):
        raise ValueError(f"cross_entropy_grad_: row_scale {tuple(row_scale.shape)} must be contiguous [{rows}]")
    if rows:
        check_targets(target, vocab, ignore_index)
        block = min(8192 if logits.is_cuda else 64, next_power_of_2(vocab))
        launch(_ce_kernel, (rows,), logits.device)(
            logits, target, out, out if row_scale is None else row_scale, logits.stride(0), vocab, ignore_index,
            float(scale), float(softcap or 1.0), SOFTCAP=bool(softcap), ROW_SCALE=row_scale is not None, BLOCK=block, num_warps=16 if block >= 4096 else 4)
    return None if losses is not None else out.sum()
