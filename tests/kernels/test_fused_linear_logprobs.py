"""Target-token logprobs through the chunked LM head vs log_softmax over full logits: values and per-token
weighted gradients (float32, torch closed form and the Triton kernel in the interpreter)."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels.cross_entropy import cross_entropy_grad_, cross_entropy_grad_ref
from fxrewrite.kernels.fused_linear_logprobs import fused_linear_logprobs, fused_linear_logprobs_ref


def _compare(scale, softcap, bias, chunk):
    gen = torch.Generator().manual_seed(3)
    N, H, V = 29, 16, 70
    h, w = torch.randn(N, H, generator=gen), torch.randn(V, H, generator=gen) * 0.4
    b = torch.randn(V, generator=gen) if bias else None
    t = torch.randint(0, V, (N,), generator=gen)
    weights = torch.randn(N, generator=gen)  # a per-token loss weight, as GRPO's advantages give
    leaves = [x.clone().requires_grad_() for x in (h, w) + ((b,) if bias else ())]
    refs = [x.clone().requires_grad_() for x in (h, w) + ((b,) if bias else ())]
    got = fused_linear_logprobs(leaves[0], leaves[1], leaves[2] if bias else None, t, scale, softcap, chunk)
    want = fused_linear_logprobs_ref(refs[0], refs[1], refs[2] if bias else None, t, scale, softcap)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    assert got.dtype == torch.float32 and got.shape == (N,)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, r in zip(leaves, refs):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale,softcap", [(1.0, None), (1 / 0.7, None), (1.0, 4.0)])
@pytest.mark.parametrize("bias", [False, True])
def test_torch_path_matches_full_logits(scale, softcap, bias):
    _compare(scale, softcap, bias, chunk=8)


@pytest.mark.parametrize("scale,softcap", [(1.0, None), (0.5, 3.0)])
def test_triton_kernel_matches_full_logits(interpret, monkeypatch, scale, softcap):
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    _compare(scale, softcap, bias=True, chunk=16)


def test_kernel_row_scale(interpret):
    gen = torch.Generator().manual_seed(0)
    logits, target = torch.randn(5, 40, generator=gen), torch.randint(0, 40, (5,), generator=gen)
    rows = torch.randn(5, generator=gen)
    _, want = cross_entropy_grad_ref(logits, target)
    z = logits.clone()
    cross_entropy_grad_(z, target, losses=torch.empty(5), row_scale=rows)
    torch.testing.assert_close(z, want * rows[:, None], rtol=1e-5, atol=1e-6)


def test_no_grad_and_bad_input():
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, 3, 4])
    with torch.no_grad():
        torch.testing.assert_close(fused_linear_logprobs(h, w, None, t), fused_linear_logprobs_ref(h, w, None, t))
    with pytest.raises(ValueError, match="target"):
        fused_linear_logprobs(h, w, None, t[:3])
    with pytest.raises(ValueError, match="dtype"):
        fused_linear_logprobs(h.double(), w, None, t)


def _clipped(old, adv, eps=0.2):
    """A GRPO-style elementwise loss of the logprobs (clipped ratio against old logprobs, per-token weights)."""
    def token_loss(lp, s, e):
        ratio = torch.exp(lp - old[s:e])
        return -torch.minimum(ratio * adv[s:e], ratio.clamp(1 - eps, 1 + eps) * adv[s:e])
    return token_loss


@pytest.mark.parametrize("triton_kernel", [False, True])
@pytest.mark.parametrize("scale, softcap, bias, chunk", [(1.0, None, False, 8), (1 / 0.7, None, True, 5),
                                                         (1.0, 3.0, False, 64)])
def test_token_loss_with_grads_in_forward_equals_logprobs_then_loss(scale, softcap, bias, chunk, triton_kernel,
                                                                   monkeypatch, request):
    """fused_linear_token_loss (gradients made in the forward) against the reference logprobs and the same
    loss through autograd: loss, logprobs and gradients of hidden, weight, bias, with ratios clipped on both
    sides of the range and exactly at 1, scaled by an incoming gradient."""
    from fxrewrite.kernels.fused_linear_logprobs import fused_linear_token_loss

    if triton_kernel:
        request.getfixturevalue("interpret")
        monkeypatch.setenv("FXREWRITE_TRITON", "1")
        from fxrewrite.kernels import fused_linear_logprobs as module

        calls = []
        monkeypatch.setattr(module, "cross_entropy_grad_",
                            lambda *a, **k: calls.append(1) or cross_entropy_grad_(*a, **k))
    gen = torch.Generator().manual_seed(5)
    N, H, V = 23, 16, 70
    h, w = torch.randn(N, H, generator=gen), torch.randn(V, H, generator=gen) * 0.4
    b = torch.randn(V, generator=gen) if bias else None
    t = torch.randint(0, V, (N,), generator=gen)
    adv = torch.randn(N, generator=gen)
    with torch.no_grad():
        lp0 = fused_linear_logprobs_ref(h, w, b, t, scale, softcap)
    old = lp0 + torch.randn(N, generator=gen) * 0.3
    old[:4] = lp0[:4]  # ratio exactly 1: the min's two branches tie
    leaves = [x.clone().requires_grad_() for x in (h, w) + ((b,) if bias else ())]
    refs = [x.clone().requires_grad_() for x in (h, w) + ((b,) if bias else ())]
    loss, lps = fused_linear_token_loss(leaves[0], leaves[1], leaves[2] if bias else None, t, _clipped(old, adv),
                                        scale, softcap, chunk)
    want_lps = fused_linear_logprobs_ref(refs[0], refs[1], refs[2] if bias else None, t, scale, softcap)
    want = _clipped(old, adv)(want_lps, 0, N).sum()
    (loss * 0.37).backward()
    (want * 0.37).backward()
    assert not lps.requires_grad and lps.shape == (N,)
    torch.testing.assert_close(lps, want_lps.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
    for a, r in zip(leaves, refs):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=1e-5)
    if triton_kernel:  # one kernel call per chunk, in the forward only
        assert len(calls) == -(-N // chunk)


def test_token_loss_under_torch_func_grad():
    """torch.func.grad through fused_linear_token_loss (its Function makes gradients in the forward, which
    functorch cannot transform): the torch reference runs, gradients equal the Function's, float32."""
    from torch.func import grad

    from fxrewrite.kernels.fused_linear_logprobs import fused_linear_token_loss

    gen = torch.Generator().manual_seed(7)
    h, w, b = torch.randn(9, 8, generator=gen), torch.randn(30, 8, generator=gen) * 0.4, torch.randn(30, generator=gen)
    t, adv = torch.randint(0, 30, (9,), generator=gen), torch.randn(9, generator=gen)
    token_loss = lambda lp, s, e: -(lp * adv[s:e])  # noqa: E731

    def loss(params):
        return fused_linear_token_loss(params[0], params[1], params[2], t, token_loss, chunk_size=4)[0]

    got = grad(loss)((h, w, b))
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    loss(leaves).backward()
    for g, leaf in zip(got, leaves):
        torch.testing.assert_close(g, leaf.grad, rtol=1e-5, atol=1e-6)
