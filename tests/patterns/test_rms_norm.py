"""RMSNorm pattern: Llama and Gemma forms, eps per instance, residual fusion, near misses."""

import torch
from torch import nn
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import fxrewrite
from fxrewrite.layers.layernorm import RMSNorm


class Block(nn.Module):
    def __init__(self, norms):
        super().__init__()
        self.norms = nn.ModuleList(norms)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        residual = x
        x = self.proj(self.norms[0](x))
        x = residual + x
        # the residual add and this norm fuse
        residual = x
        x = self.norms[1](x)
        return residual + self.proj(x)


class AddNormBlock(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm, self.proj = norm, nn.Linear(8, 8)

    def forward(self, x):
        residual = x
        x = residual + self.proj(x)

        # comments between the statements are kept
        residual = x
        x = self.norm(x)
        return residual + self.proj(x)


class OtherShapeBlock(AddNormBlock):
    def forward(self, x):
        h = x + self.proj(x)
        y = self.norm(h)
        return h + self.proj(y)


class TwoEps(LlamaRMSNorm):
    def __init__(self, size, eps):
        super().__init__(size, eps)
        self.other = eps  # a second float attribute with the same value: eps cannot be located


def _run(module):
    x = torch.randn(2, 3, 8)
    for p in module.parameters():
        p.data.normal_()
    ref = module(x)
    fxrewrite.optimize(module, example_inputs=((x,), {}))
    return fxrewrite.explain(module), ref, module(x)


def test_llama_and_gemma_forms():
    block = Block([LlamaRMSNorm(8, 1e-5), Gemma2RMSNorm(8, 1e-6)])
    report, ref, out = _run(block)
    assert [type(n) for n in block.norms] == [RMSNorm, RMSNorm]
    assert block.norms[1].offset == 1.0 and block.norms[0].offset == 0.0
    assert torch.equal(out, ref)


def test_eps_is_derived_per_instance():
    block = Block([LlamaRMSNorm(8, 1e-5), LlamaRMSNorm(8, 1e-2)])
    report, ref, out = _run(block)
    assert [n.variance_epsilon for n in block.norms] == [1e-5, 1e-2]
    assert torch.equal(out, ref)


def test_residual_add_fused_in_parent():
    block = AddNormBlock(LlamaRMSNorm(8))
    report, ref, out = _run(block)
    assert report.applied_patterns() == ["residual_rms_norm", "rms_norm"]
    assert "x, residual = self.norm(residual + self.proj(x), residual)" not in report.diff()
    assert "+    x, residual = self.norm(self.proj(x), residual)" in report.diff()
    assert "# comments between the statements are kept" in report.diff()
    assert torch.equal(out, ref)


def test_residual_refused_when_statements_differ():
    report, ref, out = _run(OtherShapeBlock(LlamaRMSNorm(8)))
    assert report.applied_patterns() == ["rms_norm"]
    assert any(p == "residual_rms_norm" and "norm" in r for _, p, r in report.skipped()), report.skipped()
    assert torch.equal(out, ref)


def test_refuses_ambiguous_eps():
    block = Block([TwoEps(8, 1e-5), TwoEps(8, 1e-5)])
    report, ref, out = _run(block)
    assert "rms_norm" not in report.applied_patterns()
    assert any(p == "rms_norm" and "expected exactly one" in r for _, p, r in report.skipped())
    assert all(type(n) is TwoEps for n in block.norms)
    assert torch.equal(out, ref)


class HalfNorm(LlamaRMSNorm):
    """Llama's norm computing in float16, not float32: the casts round, so it is no float32 RMSNorm."""

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float16)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def test_refuses_a_cast_that_rounds():
    block = Block([HalfNorm(8, 1e-5), LlamaRMSNorm(8, 1e-5)])
    report, ref, out = _run(block)
    assert type(block.norms[0]) is HalfNorm and type(block.norms[1]) is RMSNorm
    assert any(p == "rms_norm" and "float16" in r for _, p, r in report.skipped()), report.skipped()
    assert torch.equal(out, ref)
