"""Gated activations equal transformers' act(gate) * up bitwise."""

import pytest
import torch
import torch.nn.functional as F

from fxrewrite.layers.activation import GeluAndMul, SiluAndMul


def test_silu_and_mul():
    x = torch.randn(3, 10)
    assert torch.equal(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_mul(approximate):
    x = torch.randn(3, 10)
    assert torch.equal(GeluAndMul(approximate)(x), F.gelu(x[:, :5], approximate=approximate) * x[:, 5:])


def test_bad_approximate():
    with pytest.raises(ValueError, match="approximate"):
        GeluAndMul("fast")
