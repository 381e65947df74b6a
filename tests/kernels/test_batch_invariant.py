"""Batch-invariant linear: a row's output is bitwise the same in any batch, and close to F.linear."""

import torch
import torch.nn.functional as F

from fxrewrite.kernels.batch_invariant import batch_invariant_mode, is_batch_invariant, linear_batch_invariant


def test_rows_bitwise_equal_alone_and_batched():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 200, generator=g), torch.randn(96, generator=g)
    x = torch.randn(37, 200, generator=g)
    batched = linear_batch_invariant(x, w, b)
    for i in (0, 5, 36):
        assert torch.equal(linear_batch_invariant(x[i : i + 1], w, b)[0], batched[i])
        assert torch.equal(linear_batch_invariant(x[i : i + 3], w, b)[0], batched[i])
    torch.testing.assert_close(batched, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert linear_batch_invariant(x.view(1, 37, 200), w).shape == (1, 37, 96)
    assert linear_batch_invariant(x[:0], w).shape == (0, 96)


def test_mode_routes_f_linear_and_nests():
    w, x = torch.randn(8, 16), torch.randn(5, 16)
    assert not is_batch_invariant()
    with batch_invariant_mode():
        with batch_invariant_mode():
            assert is_batch_invariant()
        assert is_batch_invariant()
        assert torch.equal(_linear(w)(x), linear_batch_invariant(x, w))  # nn.Linear goes through the mode
    with batch_invariant_mode(enabled=False):
        assert not is_batch_invariant()
    assert not is_batch_invariant()


def _linear(w):
    layer = torch.nn.Linear(16, 8, bias=False)
    layer.weight.data.copy_(w)
    return layer
