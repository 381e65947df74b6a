"""Gated-MLP pattern on tiny modules: silu/gelu variants, operand order, near misses, partial traces."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxrewrite
from fxrewrite.layers.activation import GeluAndMul, SiluAndMul


class GLUMLP(nn.Module):
    def __init__(self, act=None, bias=False):
        super().__init__()
        self.gate_proj = nn.Linear(8, 12, bias=bias)
        self.up_proj = nn.Linear(8, 12, bias=bias)
        self.down_proj = nn.Linear(12, 8)
        self.act_fn = act or nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ReversedGLUMLP(GLUMLP):
    def forward(self, x):
        return self.down_proj(self.up_proj(x) * self.act_fn(self.gate_proj(x)))


class FunctionalGLUMLP(GLUMLP):
    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class SplitStatementsMLP(GLUMLP):
    def forward(self, x):
        gate = self.act_fn(self.gate_proj(x))
        return self.down_proj(gate * self.up_proj(x))


class NotAnMLP(GLUMLP):
    def forward(self, x):
        return self.down_proj(self.gate_proj(x) * self.up_proj(x))


class UntraceableTailGLUMLP(GLUMLP):
    def forward(self, x):
        h = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        if h.sum() > 1e9:  # data-dependent: the trace stops here, the graph before it is kept
            h = h * 0
        return h


def _run(module):
    x = torch.randn(3, 8)
    ref = module(x)
    fxrewrite.optimize(module, example_inputs=((x,), {}))
    return fxrewrite.explain(module), ref, module(x)


@pytest.mark.parametrize("act, layer", [(nn.SiLU(), SiluAndMul), (nn.GELU(), GeluAndMul),
                                        (nn.GELU(approximate="tanh"), GeluAndMul)])
def test_activation_found_by_what_it_computes(act, layer):
    module = GLUMLP(act, bias=True)
    report, ref, out = _run(module)
    assert report.applied_patterns() == ["glu"] and isinstance(module.act_and_mul, layer)
    torch.testing.assert_close(out, ref)


def test_an_in_place_activation_is_fused_with_the_same_values_and_gradients():
    """``nn.SiLU(inplace=True)`` overwrites the gate's output, which nothing else reads: fused like nn.SiLU() (a fresh
    user's report said "activation act_fn is not silu/gelu/gelu_tanh": the probe ran it on its own input)."""
    torch.manual_seed(0)
    module, stock = GLUMLP(nn.SiLU(inplace=True), bias=True), GLUMLP(nn.SiLU(inplace=True), bias=True)
    stock.load_state_dict(module.state_dict())
    x = torch.randn(3, 8)
    fxrewrite.optimize(module, example_inputs=((x,), {}))
    assert fxrewrite.explain(module).applied_patterns() == ["glu"] and isinstance(module.act_and_mul, SiluAndMul)
    out, ref = module(x), stock(x)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    got = dict(module.named_parameters())
    for name, p in stock.named_parameters():  # gate / up: the fused rows, below
        if not name.startswith(("gate_proj", "up_proj")):
            torch.testing.assert_close(got[name].grad, p.grad)
    rows = module.gate_up_proj.weight.grad
    torch.testing.assert_close(rows, torch.cat([stock.gate_proj.weight.grad, stock.up_proj.weight.grad]))


@pytest.mark.parametrize("cls", [ReversedGLUMLP, FunctionalGLUMLP])
def test_variants_fused(cls):
    report, ref, out = _run(cls())
    assert report.applied_patterns() == ["glu"]
    torch.testing.assert_close(out, ref)


def test_untraceable_tail_keeps_partial_graph():
    report, ref, out = _run(UntraceableTailGLUMLP())
    assert report.applied_patterns() == ["glu"]
    assert any(p == "trace" and "control flow" in r for _, p, r in report.skipped())
    torch.testing.assert_close(out, ref)


def _refused(module, reason):
    report, ref, out = _run(module)
    assert report.applied_patterns() == []
    assert any(p == "glu" and reason in r for _, p, r in report.skipped()), report.skipped()
    assert hasattr(module, "gate_proj") and "forward" not in vars(module)
    torch.testing.assert_close(out, ref)


def test_refuses_unknown_activation():
    _refused(GLUMLP(nn.ReLU()), "is not silu/gelu/gelu_tanh")


def test_refuses_an_activation_with_dropout_probed_in_eval_mode():
    """silu then dropout computes silu in eval mode only: fused, train mode would lose the dropout."""
    module = GLUMLP(nn.Sequential(nn.SiLU(), nn.Dropout(0.5))).eval()
    _refused(module, "is not silu/gelu/gelu_tanh")
    assert module.training is False and module.act_fn[1].training is False  # the probe put the flags back


def test_refuses_product_split_over_statements():
    _refused(SplitStatementsMLP(), "not one expression")


def test_refuses_bias_mismatch():
    module = GLUMLP()
    module.up_proj = nn.Linear(8, 12, bias=True)
    _refused(module, "disagree on bias")


def test_no_activation_is_not_a_match():
    report, ref, out = _run(NotAnMLP())
    assert report.applied_patterns() == [] and report.skipped() == []


def test_validate_is_per_instance():
    pair = nn.Sequential(GLUMLP(nn.SiLU()), GLUMLP(nn.ReLU()))  # same class, different activation
    report, ref, out = _run(pair)
    assert report.classes["GLUMLP"].applied == {"glu": {"gate_proj,up_proj -> gate_up_proj + silu_and_mul": 1}}
    # the ReLU instance has another child class: it is traced and judged on its own, named in the reason
    assert ("GLUMLP", "glu", "[1] activation act_fn is not silu/gelu/gelu_tanh") in report.skipped()
    assert "forward" in vars(pair[0]) and "forward" not in vars(pair[1]) and hasattr(pair[1], "gate_proj")
    torch.testing.assert_close(out, ref)
