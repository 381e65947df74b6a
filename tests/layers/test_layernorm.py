"""RMSNorm layer vs transformers' Llama/Gemma2 norms (bitwise in float32), fused residual form."""

import torch
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from fxrewrite.layers.layernorm import RMSNorm


def test_llama_form_bitwise():
    ref = LlamaRMSNorm(16, eps=1e-5)
    ref.weight.data.normal_()
    layer = RMSNorm(16, eps=1e-5)
    layer.weight.weight_loader(layer.weight, ref.weight.data)
    x = torch.randn(2, 3, 16)
    assert torch.equal(layer(x), ref(x))


def test_gemma_offset_form_bitwise():
    ref = Gemma2RMSNorm(16, eps=1e-6)
    ref.weight.data.normal_()
    layer = RMSNorm(16, eps=1e-6, offset=1.0)
    layer.weight.data.copy_(ref.weight.data)
    x = torch.randn(4, 16)
    assert torch.equal(layer(x), ref(x))


def test_fused_residual_add():
    layer = RMSNorm(8)
    x, res = torch.randn(3, 8), torch.randn(3, 8)
    out, new_res = layer(x, res)
    assert torch.equal(new_res, res + x)
    assert torch.equal(out, layer(res + x))


def test_grad_flows():
    layer = RMSNorm(8)
    x = torch.randn(3, 8, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
