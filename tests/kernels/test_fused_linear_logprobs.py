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
