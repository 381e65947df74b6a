"""Projections a model ships fused (Phi-3's ``qkv_proj`` sliced by its forward, ``gate_up_proj`` chunked in two):
proven q | k | v at head boundaries (and halves that meet only in ``act(a) * b``), the module keeps its weights, its
slices become one split by ``qkv_output_sizes``, and `PREFUSED_ATTR` records them for tensor parallelism; any other
form is reported as present and left as it was. Sharding itself: tests/distributed/test_tp_prefused.py."""

import torch
import torch.nn.functional as F
from torch import nn

import fxrewrite
from fxrewrite.patterns.base import PREFUSED_ATTR


class SlicedAttn(nn.Module):
    """Phi-3's form: one linear, three [..., a:b] slices in three statements."""

    def __init__(self, hidden=16, heads=4, kv_heads=2, head_dim=4):
        super().__init__()
        self.head_dim, self.heads, self.kv_heads = head_dim, heads, kv_heads
        self.qkv_proj = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        qkv = self.qkv_proj(hidden_states)
        q_end = self.heads * self.head_dim
        q = qkv[..., :q_end]
        k = qkv[..., q_end:q_end + self.kv_heads * self.head_dim]
        v = qkv[..., q_end + self.kv_heads * self.head_dim:]
        return self._attend(q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2))

    def _attend(self, q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class KeysFirstAttn(SlicedAttn):
    """The same tensor laid out k | q | v: not q | k | v, so nothing may treat it as such."""

    def forward(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        qkv = self.qkv_proj(hidden_states)
        kv = self.kv_heads * self.head_dim
        k = qkv[..., :kv]
        q = qkv[..., kv:kv + self.heads * self.head_dim]
        v = qkv[..., kv + self.heads * self.head_dim:]
        return self._attend(q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2))


class OneStatementAttn(SlicedAttn):
    """Proven in the graph, but the three slices share one statement: the source edit refuses."""

    def forward(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        qkv = self.qkv_proj(hidden_states)
        a, b = self.heads * self.head_dim, (self.heads + self.kv_heads) * self.head_dim
        q, k, v = qkv[..., :a], qkv[..., a:b], qkv[..., b:]
        return self._attend(q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2))


class PerLayerAttn(SlicedAttn):
    """Bounds read from a per-layer table: the trace of one layer cannot speak for another (a review found layer 1
    split by layer 0's sizes: same total width, other heads)."""

    TABLE = [(4, 2), (6, 1)]

    def __init__(self, layer_idx):
        super().__init__(head_dim=8, heads=4, kv_heads=2)
        self.layer_idx = layer_idx

    def forward(self, hidden_states):
        heads, kv = self.TABLE[self.layer_idx]
        qkv = self.qkv_proj(hidden_states)
        q = qkv[..., :heads * self.head_dim]
        k = qkv[..., heads * self.head_dim:(heads + kv) * self.head_dim]
        v = qkv[..., (heads + kv) * self.head_dim:]
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        out = F.scaled_dot_product_attention(*(t.view(shape).transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                             enable_gqa=True).transpose(1, 2).flatten(2)
        return self.o_proj(F.pad(out, (0, 32 - out.shape[-1])))


class HeadsConfig:
    def __init__(self, heads, kv_heads):
        self.num_attention_heads, self.num_key_value_heads = heads, kv_heads


class PerInstanceAttn(SlicedAttn):
    """Bounds from the instance's config (Phi-3's form): proven per instance (layer 1 differs, the same width)."""

    def __init__(self, heads, kv_heads):
        super().__init__(head_dim=8, heads=4, kv_heads=2)
        self.config = HeadsConfig(heads, kv_heads)
        self.o_proj = nn.Linear(64, 16, bias=False)

    def forward(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        qkv = self.qkv_proj(hidden_states)
        q_end = self.config.num_attention_heads * self.head_dim
        q = qkv[..., :q_end]
        k = qkv[..., q_end:q_end + self.config.num_key_value_heads * self.head_dim]
        v = qkv[..., q_end + self.config.num_key_value_heads * self.head_dim:]
        return self._attend(q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2))

    def _attend(self, q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).flatten(2)
        return self.o_proj(F.pad(out, (0, 64 - out.shape[-1])))


class ArgumentAttn(SlicedAttn):
    """Bounds from a call argument: the traced call's values are not the next call's."""

    def forward(self, hidden_states, heads=4, kv_heads=2):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        qkv = self.qkv_proj(hidden_states)
        q = qkv[..., :heads * self.head_dim]
        k = qkv[..., heads * self.head_dim:(heads + kv_heads) * self.head_dim]
        v = qkv[..., (heads + kv_heads) * self.head_dim:]
        out = F.scaled_dot_product_attention(*(t.view(shape).transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                             enable_gqa=True).transpose(1, 2).flatten(2)
        return self.o_proj(F.pad(out, (0, 16 - out.shape[-1])))


class Stack(nn.Module):
    def __init__(self, *layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


class ChunkedMLP(nn.Module):
    def __init__(self, hidden=16, inter=24, combine="act"):
        super().__init__()
        self.combine = combine
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.combine == "act":
            return self.down_proj(up * F.silu(gate))
        return self.down_proj(gate * up.flip(-1))  # not elementwise across the halves' columns: no rank split


def _optimize(module):
    x = torch.randn(2, 5, 16)
    ref = module(x)
    out = fxrewrite.optimize(module, example_inputs=((x,), {}))
    return fxrewrite.explain(out), ref, out(x), out


def test_sliced_qkv_becomes_one_split_with_the_same_outputs():
    report, ref, got, module = _optimize(SlicedAttn())
    assert report.applied_patterns() == ["qkv"] and report.present_patterns() == []
    assert "_fx_q, _fx_k, _fx_v = qkv.split(self.qkv_output_sizes, dim=-1)" in report.diff()
    assert type(module.qkv_proj) is nn.Linear and module.qkv_output_sizes == [16, 8, 8]
    kind, name, facts = module.__dict__[PREFUSED_ATTR][0]
    assert (kind, name, facts["head_size"], facts["num_heads"], facts["num_kv_heads"], facts["row_partner"]) == (
        "qkv", "qkv_proj", 4, 4, 2, "o_proj")
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_keys_first_layout_is_only_reported():
    report, ref, got, module = _optimize(KeysFirstAttn())
    assert report.present_patterns() == ["qkv"] and "qkv" not in report.applied_patterns()
    assert PREFUSED_ATTR not in module.__dict__ and "qkv_output_sizes" not in report.diff()
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_slices_sharing_a_statement_are_refused_with_the_reason():
    report, ref, got, module = _optimize(OneStatementAttn())
    assert "qkv" not in report.applied_patterns() and PREFUSED_ATTR not in module.__dict__
    assert any("not three statements" in why for _, _, why in report.skipped()), report.skipped()
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_chunked_gate_up_is_recorded_only_when_the_halves_meet_in_act_times_up():
    report, ref, got, module = _optimize(ChunkedMLP())
    assert report.applied_patterns() == ["glu"]
    facts = {"sizes": [24, 24], "row_partner": "down_proj", "row_partner_why": None}
    assert module.__dict__[PREFUSED_ATTR] == [("merged", "gate_up_proj", facts)]
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    report, ref, got, module = _optimize(ChunkedMLP(combine="flip"))
    assert report.present_patterns() == ["glu"] and PREFUSED_ATTR not in module.__dict__
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_bounds_not_built_from_the_instance_are_refused():
    x = torch.randn(2, 5, 16)
    model = Stack(PerLayerAttn(0), PerLayerAttn(1))
    ref = model(x)
    out = fxrewrite.optimize(model, example_inputs=((x,), {}))
    torch.testing.assert_close(out(x), ref, rtol=0, atol=0)
    assert any("not built from int literals" in why for _, _, why in fxrewrite.explain(out).skipped())
    attn = ArgumentAttn()
    ref = attn(x, heads=6, kv_heads=1)
    out = fxrewrite.optimize(attn, example_inputs=((x,), {}))
    assert "qkv" not in fxrewrite.explain(out).applied_patterns()
    torch.testing.assert_close(out(x, heads=6, kv_heads=1), ref, rtol=0, atol=0)


def test_each_instance_proves_its_own_bounds():
    x = torch.randn(2, 5, 16)
    model = Stack(PerInstanceAttn(4, 2), PerInstanceAttn(6, 1))  # 32 | 16 | 16 and 48 | 8 | 8: one width
    ref = model(x)
    out = fxrewrite.optimize(model, example_inputs=((x,), {}))
    torch.testing.assert_close(out(x), ref, rtol=0, atol=0)
    first, second = out.layers
    assert first.qkv_output_sizes == [32, 16, 16]  # the second: its own sizes, or left as it was when one trace
    assert getattr(second, "qkv_output_sizes", [48, 8, 8]) == [48, 8, 8]  # served both (the report says why)
    skipped = [why for _, _, why in fxrewrite.explain(out).skipped()]
    assert hasattr(second, "qkv_output_sizes") or any("not the traced [32, 16, 16]" in why for why in skipped)


def test_an_instance_whose_bounds_differ_from_the_trace_is_refused():
    """Instances traced together (one group) are each checked against the trace's sizes before any change."""
    import pytest

    from fxrewrite.patterns.base import Context, Match, Refusal
    from fxrewrite.patterns.qkv import QKVPattern

    facts = (("head_size", 8), ("sizes", (32, 16, 16)), ("row_partner", "o_proj"), ("prefused", True))
    match = Match(QKVPattern, frozenset(), (("qkv", "qkv_proj"),), facts)
    QKVPattern.validate(match, PerInstanceAttn(4, 2), Context(model=None))
    with pytest.raises(Refusal, match=r"slices of qkv_proj are \[\(0, 48\), \(48, 56\), \(56, 64\)\], not the "
                                      r"traced \[32, 16, 16\]"):
        QKVPattern.validate(match, PerInstanceAttn(6, 1), Context(model=None))
