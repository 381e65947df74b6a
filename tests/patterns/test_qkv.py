"""QKV pattern on tiny HF-shaped attention modules: fused numerics, and one test per refusal kind."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import fxrewrite
from fxrewrite.layers.linear import QKVParallelLinear


class Attn(nn.Module):
    def __init__(self, hidden=16, heads=4, kv_heads=2, head_dim=4, bias=(False, False, False)):
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias[0])
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias[1])
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias[2])
        self.o_proj = nn.Linear(heads * head_dim, hidden)

    def forward(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        # comments survive the rewrite
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        return self._attend(q, k, v)

    def _attend(self, q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class ReassignedAttn(Attn):
    def forward(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        x = hidden_states
        q = self.q_proj(x).view(shape).transpose(1, 2)
        x = hidden_states  # same value, but the source alone cannot prove it
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        return self._attend(q, k, v)


class DifferentInputAttn(Attn):
    def forward(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        hidden_states = hidden_states * 2.0
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        return self._attend(q, k, v)


class TwiceAttn(Attn):
    def forward(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if hidden_states.shape[0] > 100:
            q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        return self._attend(q, k, v)


class ShadowAttn(Attn):
    def forward(self, hidden_states):
        _fx_q = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(_fx_q).transpose(1, 2)
        k = self.k_proj(hidden_states).view(_fx_q).transpose(1, 2)
        v = self.v_proj(hidden_states).view(_fx_q).transpose(1, 2)
        return self._attend(q, k, v)


def _optimize(module):
    x = torch.randn(2, 5, 16)
    ref = module(x)
    out_module = fxrewrite.optimize(module, example_inputs=((x,), {}))
    return fxrewrite.explain(out_module), ref, module(x)


def test_fused_gqa_matches():
    report, ref, out = _optimize(Attn())
    assert report.applied_patterns() == ["qkv"]
    torch.testing.assert_close(out, ref)
    assert "# comments survive the rewrite" in report.diff()


def test_fused_with_bias_matches():
    module = Attn(bias=(True, True, True))
    report, ref, out = _optimize(module)
    assert isinstance(module.qkv_proj, QKVParallelLinear) and module.qkv_proj.bias is not None
    torch.testing.assert_close(out, ref)


def _refused(module, reason):
    before = copy.deepcopy(module.state_dict())
    report, ref, out = _optimize(module)
    assert report.applied_patterns() == []
    assert any(p == "qkv" and reason in r for _, p, r in report.skipped()), report.skipped()
    assert "forward" not in vars(module) and module.state_dict().keys() == before.keys()
    torch.testing.assert_close(out, ref)


def test_refuses_bias_mismatch():
    _refused(Attn(bias=(True, False, False)), "disagree on bias")


def test_refuses_input_reassigned():
    _refused(ReassignedAttn(), "reassigned")


def test_refuses_call_appearing_twice():
    _refused(TwiceAttn(), "appears 2 times")


def test_refuses_shadowed_temporary():
    _refused(ShadowAttn(), "shadow")


def test_refuses_k_v_size_mismatch():
    module = Attn()
    module.v_proj = nn.Linear(16, 4)
    _refused(module, "sizes differ")


def test_different_inputs_are_not_a_match():
    report, ref, out = _optimize(DifferentInputAttn())
    assert report.applied_patterns() == [] and report.skipped() == []
    torch.testing.assert_close(out, ref)
