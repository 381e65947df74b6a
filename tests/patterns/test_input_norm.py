"""The decoder layer's input norm folded into its attention's qkv_proj (``input_layernorm -> self_attn qkv_proj``):
applied only where the QKV rewrite proved the attention reads that input through q/k/v alone and the norm's result
has no other reader; the fused path runs only without autograd, hooks, a replaced forward or torch.compile's
tracing; outputs and gradients are the unfused ones'."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import fxrewrite
from tests.patterns.conftest import assert_same_gradients, count_calls
from fxrewrite.layers.input_norm import NORMED_INPUT_ATTR
from fxrewrite.layers.linear import QKVParallelLinear


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
        self.o_proj = nn.Linear(8, 8)

    def forward(self, hidden_states, scale=1.0):
        shape = hidden_states.shape[:-1]
        q = self.q_proj(hidden_states).view(*shape, -1, 4)
        k = self.k_proj(hidden_states).view(*shape, -1, 4).repeat_interleave(2, -2)
        v = self.v_proj(hidden_states).view(*shape, -1, 4).repeat_interleave(2, -2)
        out = (q * k).sum(-1, keepdim=True).sigmoid() * v * scale
        return self.o_proj(out.reshape(*shape, -1)), None


class GatedAttn(Attn):
    def forward(self, hidden_states, scale=1.0):
        shape = hidden_states.shape[:-1]
        q = self.q_proj(hidden_states).view(*shape, -1, 4)
        k = self.k_proj(hidden_states).view(*shape, -1, 4).repeat_interleave(2, -2)
        v = self.v_proj(hidden_states).view(*shape, -1, 4).repeat_interleave(2, -2)
        out = ((q * k).sum(-1, keepdim=True).sigmoid() * v).reshape(*shape, -1)
        return self.o_proj(out * torch.sigmoid(hidden_states)), None  # the input read beside q/k/v


class Layer(nn.Module):
    def __init__(self, attn_cls=Attn):
        super().__init__()
        self.input_layernorm, self.self_attn = LlamaRMSNorm(8), attn_cls()

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, scale=0.5)
        return residual + hidden_states


class PositionalLayer(Layer):
    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states)
        return residual + hidden_states


class SecondParamAttn(Attn):
    def forward(self, gate_in, hidden_states):  # q/k/v read the second parameter
        shape = hidden_states.shape[:-1]
        q = self.q_proj(hidden_states).view(*shape, -1, 4)
        k = self.k_proj(hidden_states).view(*shape, -1, 4).repeat_interleave(2, -2)
        v = self.v_proj(hidden_states).view(*shape, -1, 4).repeat_interleave(2, -2)
        out = ((q * k).sum(-1, keepdim=True).sigmoid() * v).reshape(*shape, -1)
        return self.o_proj(out) * torch.sigmoid(gate_in), None


class FirstPositionalLayer(Layer):
    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states, residual)  # the normed x goes to gate_in, not q/k/v
        return residual + hidden_states


class BranchReadLayer(Layer):
    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        out, _ = self.self_attn(hidden_states=hidden_states)
        if self.training:  # a read of the normed x on a path the (eval) trace did not take
            out = out + hidden_states
        return residual + out


class TwoReadersLayer(Layer):
    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        out, _ = self.self_attn(hidden_states=hidden_states)
        return residual + out + hidden_states


def _optimized(layer_cls=Layer, attn_cls=Attn):
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(layer_cls(attn_cls), layer_cls(attn_cls))
        for p in model.parameters():
            p.data.normal_(0, 0.5)
        return model

    ref, model = build(), build()
    fxrewrite.optimize(model, example_inputs=((torch.randn(2, 3, 8),), {}))
    return ref, model, fxrewrite.explain(model)


@pytest.fixture
def norm_forward_calls(monkeypatch):
    """How often the fused path ran (qkv_proj's `norm_forward`)."""
    return count_calls(monkeypatch, QKVParallelLinear, "norm_forward")


def _same(model, ref, x) -> None:
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layer_cls", [Layer, PositionalLayer], ids=["keyword", "positional"])
def test_fold_applies_and_matches(norm_forward_calls, layer_cls):
    ref, model, report = _optimized(layer_cls)
    assert "input_norm: input_layernorm -> self_attn qkv_proj" in str(report)
    assert "self.input_layernorm.forward_into(" in report.diff()
    assert model[0].self_attn.__dict__[NORMED_INPUT_ATTR] == ("hidden_states", "qkv_proj", 0)
    assert model[0].self_attn.qkv_proj.gemv_prologue == "norm"
    _same(model, ref, torch.randn(2, 5, 8))
    assert len(norm_forward_calls) == 2  # one per layer: the fused path ran


def test_training_normalises_first_and_matches_gradients(norm_forward_calls):
    ref, model, _ = _optimized()
    assert_same_gradients(ref, model, torch.randn(2, 5, 8), "qkv_proj", ("q_proj", "k_proj", "v_proj"))
    assert not norm_forward_calls


@pytest.mark.parametrize("where", ["norm", "attention", "qkv_proj"])
def test_a_hook_added_later_takes_the_unfused_path(norm_forward_calls, where):
    ref, model, _ = _optimized()
    module = {"norm": model[1].input_layernorm, "attention": model[1].self_attn,
              "qkv_proj": model[1].self_attn.qkv_proj}[where]
    seen = []
    module.register_forward_pre_hook(lambda m, args, *rest: seen.append(1))
    _same(model, ref, torch.randn(1, 2, 8))
    assert len(norm_forward_calls) == 1 and seen == [1]  # layer 0 fused; layer 1's hook ran on the unfused path


def test_a_replaced_qkv_forward_runs_on_the_normed_input(norm_forward_calls):
    ref, model, _ = _optimized()
    qkv = model[0].self_attn.qkv_proj
    qkv.forward = lambda x: torch.nn.functional.linear(x, qkv.weight, qkv.bias)  # someone else's forward
    _same(model, ref, torch.randn(1, 2, 8))
    assert len(norm_forward_calls) == 1


@pytest.mark.parametrize("layer_cls, attn_cls", [(Layer, GatedAttn), (TwoReadersLayer, Attn),
                                                 (FirstPositionalLayer, SecondParamAttn), (BranchReadLayer, Attn)],
                         ids=["input-read-beside-qkv", "norm-read-twice", "positional-to-another-param",
                              "read-in-an-untraced-branch"])
def test_not_proven_keeps_the_norm_call(layer_cls, attn_cls):
    ref, model, report = _optimized(layer_cls, attn_cls)
    assert "qkv" in report.applied_patterns() and "input_norm" not in report.applied_patterns()
    assert "forward_into" not in report.diff()
    _same(model, ref, torch.randn(2, 3, 8))
    ref.train(), model.train()
    with torch.no_grad():
        torch.testing.assert_close(model(x := torch.randn(2, 3, 8)), ref(x), rtol=1e-5, atol=1e-6)


def test_compiles_without_a_graph_break(norm_forward_calls):
    ref, model, _ = _optimized()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    _same(compiled, ref, torch.randn(1, 3, 8))
    assert not norm_forward_calls
