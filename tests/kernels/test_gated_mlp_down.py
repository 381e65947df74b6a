"""down(act(gate) * up) for training (Triton activation kernels in the interpreter, row chunks) vs autograd
through the reference; and the gated-MLP rewrite calling it with the model's down projection."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxrewrite.kernels import gated_mlp_down
from fxrewrite.kernels.gated_mlp_down import ActAndMulDownFunction, _row_chunk, act_and_mul_down_ref, act_and_mul_down_train
from fxrewrite.layers.activation import SiluAndMul


@pytest.fixture
def forced(interpret, monkeypatch):
    monkeypatch.setenv("FXREWRITE_TRITON", "1")


def _run(fn, x, w, b, act):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    b = b.detach().clone().requires_grad_() if b is not None else None
    out = fn(x, w, b, act)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * dy).sum().backward()
    return out.detach(), x.grad, w.grad, (b.grad if b is not None else None)


@pytest.mark.parametrize("act,bias,chunk", [("silu", False, 2), ("silu", True, None), ("gelu", True, 2),
                                            ("gelu_tanh", False, None)])
def test_grads_match_reference(forced, monkeypatch, act, bias, chunk):
    if chunk:  # several row chunks at a size the interpreter runs fast (real sizes: 128-row multiples)
        monkeypatch.setattr(gated_mlp_down, "_row_chunk", lambda rows, d, out, accumulate=False: chunk)
    x, w = torch.randn(5, 2 * 8), torch.randn(4, 8)
    b = torch.randn(4) if bias else None
    got = _run(lambda *a: act_and_mul_down_train(*a, inplace_backward=True), x, w, b, act)
    want = _run(act_and_mul_down_ref, x, w, b, act)
    for g, r in zip(got, want):
        if r is not None:
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_row_chunk_bounds_the_transient():
    assert _row_chunk(16384, 3072, 1024) == 5504  # Qwen3-0.6B: a third of the rows, 128-aligned
    assert _row_chunk(300, 40, 8) == 128 and _row_chunk(10, 4, 8) == 128
    # the backward's float32 d/dweight sum counts: still chunked where chunks save more than it costs (0.6B:
    # 33 MiB chunk + 12 MiB sum < 96 MiB), one chunk where they do not (Llama-3.1-8B at 2048 rows: 14 + 224 > 56 MiB)
    assert _row_chunk(16384, 3072, 1024, accumulate=True) == 5504
    assert _row_chunk(2048, 14336, 4096) == 512 and _row_chunk(2048, 14336, 4096, accumulate=True) == 2048


def test_errors(forced):
    with pytest.raises(ValueError, match="act="):
        act_and_mul_down_train(torch.randn(2, 8), torch.randn(3, 4), None, "relu")
    with pytest.raises(ValueError, match=r"must be \[out, 4\]"):
        act_and_mul_down_train(torch.randn(2, 8), torch.randn(3, 5), None)


def test_layer_takes_the_function_only_for_a_plain_linear(forced, monkeypatch):
    calls = []
    original = ActAndMulDownFunction.apply
    monkeypatch.setattr(ActAndMulDownFunction, "apply", lambda *a: calls.append(1) or original(*a))
    act, down = SiluAndMul(inplace_backward=True), nn.Linear(6, 4)
    x = torch.randn(3, 12, requires_grad=True)
    torch.testing.assert_close(act(x, down), down(act(x)))
    assert calls == [1]
    down.register_forward_hook(lambda *a: None)  # a hooked (or wrapped) projection is called as it is
    act(x, down)
    with torch.no_grad():
        act(x, nn.Linear(6, 4))
    assert calls == [1]
