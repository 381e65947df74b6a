"""Qwen3's q/k-norm + rotary training kernel (Triton forward + backward, in the interpreter) vs autograd through
the reference, on strided views of a fused QKV output as the rewritten attention passes them."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels.qk_norm_rope_backward import (QKNormRopeFunction, fits, qk_norm_rope_train,
                                                     qk_norm_rope_train_ref)
from fxrewrite.kernels.rms_norm_backward import rms_norm_train
from fxrewrite.kernels.rotary_backward import rotary_apply_train

B, S, HQ, HK, D = 2, 5, 4, 2, 8  # 10 tokens: the last backward program runs past the end


@pytest.fixture
def forced(interpret, monkeypatch):
    monkeypatch.setenv("FXREWRITE_TRITON", "1")


def _qkv(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, (HQ + 2 * HK) * D, generator=gen).to(dtype).requires_grad_()


def _heads(qkv):
    q, k, _ = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    return q.view(B, S, -1, D).transpose(1, 2), k.view(B, S, -1, D).transpose(1, 2)


def _run(fn, qkv, weights):
    for t in (qkv, *weights):
        t.grad = None
    q, k = _heads(qkv)
    oq, ok = fn(q, k)
    gen = torch.Generator().manual_seed(3)
    loss = (oq * torch.randn(oq.shape, generator=gen).to(oq.dtype)).sum()
    (loss + (ok * torch.randn(ok.shape, generator=gen).to(ok.dtype)).sum()).backward()
    return [oq.detach(), ok.detach(), qkv.grad.clone(), *(w.grad.clone() for w in weights)]


@pytest.mark.parametrize("rotary_dim,neox,cos_batch", [(D // 2, True, B), (D, False, 1)])
def test_grads_match_reference(forced, rotary_dim, neox, cos_batch):
    qkv = _qkv()
    cos, sin = torch.randn(cos_batch, S, rotary_dim), torch.randn(cos_batch, S, rotary_dim)
    weights = (torch.randn(D, requires_grad=True), torch.randn(D, requires_grad=True))
    got = _run(lambda q, k: QKNormRopeFunction.apply(q, k, cos, sin, *weights, 1e-6, 1e-5, neox), qkv, weights)
    want = _run(lambda q, k: qk_norm_rope_train_ref(q, k, cos, sin, *weights, 1e-6, 1e-5, neox), qkv, weights)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert got[0].transpose(1, 2).is_contiguous()  # [B, S, H, D] in memory: SDPA's and the split's layout


def test_bf16_forward_equals_the_unfused_training_kernels(forced):
    """Same roundings as rms_norm_train then rotary_apply_train: equal outputs, gradients within bf16 steps."""
    qkv = _qkv(torch.bfloat16)
    cos, sin = torch.randn(1, S, D).cos(), torch.randn(1, S, D).sin()
    weights = (torch.randn(D).bfloat16().requires_grad_(), torch.randn(D).bfloat16().requires_grad_())

    def unfused(q, k):
        return rotary_apply_train(rms_norm_train(q, weights[0], 1e-6), rms_norm_train(k, weights[1], 1e-6), cos, sin)

    got = _run(lambda q, k: qk_norm_rope_train(q, k, cos, sin, *weights, 1e-6, 1e-6), qkv, weights)
    want = _run(unfused, qkv, weights)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    for g, w in zip(got[2:], want[2:]):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


def test_saves_the_input_views_only(forced):
    """Nothing but the q/k views (of the QKV output), cos/sin and the weights is saved: no copies, no rstd."""
    qkv = _qkv()
    cos, sin = torch.randn(1, S, D), torch.randn(1, S, D)
    weights = (torch.randn(D, requires_grad=True), torch.randn(D, requires_grad=True))
    q, k = _heads(qkv)
    oq, _ = QKNormRopeFunction.apply(q, k, cos, sin, *weights, 1e-6, 1e-6, True)
    saved = oq.grad_fn.saved_tensors
    assert len(saved) == 6
    assert all(t.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr() for t in saved[:2])


def test_falls_back_outside_the_kernel_contract(forced):
    q, k = _heads(_qkv())
    cos = torch.randn(1, S, D)
    w32, w64 = torch.randn(D), torch.randn(D, dtype=torch.float64)
    assert fits(q, k, cos, cos, w32, w32)
    assert not fits(q, k, cos, cos, w32, w64)  # a weight of another dtype promotes the output: the reference
    assert not fits(q, k, cos.requires_grad_(), cos, w32, w32)
    out = qk_norm_rope_train(q, k, cos, cos, w32, w64, 1e-6, 1e-6)
    assert out[0].grad_fn is not None and type(out[0].grad_fn).__name__ != "QKNormRopeFunctionBackward"
