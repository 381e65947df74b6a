"""Forwards whose recompiled source would mean something else are refused (issue 15 item 14):
closure variables and name-mangled private names. The module stays as it was; the report says why."""

import torch
from torch import nn

import fxrewrite
from fxrewrite.patterns.glu import GLUPattern


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.act_fn = nn.Linear(4, 6), nn.Linear(4, 6), nn.SiLU()
        self.down_proj = nn.Linear(6, 4)


def _make_closure_mlp(scale):
    class ClosureMLP(_MLP):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * scale

    return ClosureMLP


scale = 100.0  # a global of the same name: the recompiled forward would read this one


class PrivateMLP(_MLP):
    def __init__(self):
        super().__init__()
        self.__scale = 3.0

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * self.__scale


class PlainMLP(_MLP):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _check_refused(module, reason):
    x = torch.randn(3, 4)
    with torch.no_grad():
        want = module(x)
    fxrewrite.optimize(module, example_inputs=((x,), {}), patterns=(GLUPattern,))
    entry = fxrewrite.explain(module).classes[type(module).__name__]
    assert not entry.applied and "forward" not in vars(module) and hasattr(module, "gate_proj")
    assert any(p == "glu" and reason in r for p, r in entry.skipped), entry.skipped
    with torch.no_grad():
        torch.testing.assert_close(module(x), want, rtol=0, atol=0)


def test_closure_variable_is_refused():
    _check_refused(_make_closure_mlp(0.5)(), "closure variable(s) scale")


def test_name_mangled_attribute_is_refused():
    _check_refused(PrivateMLP(), "name-mangled private name(s) __scale")


def test_plain_forward_is_still_rewritten():
    module = PlainMLP()
    x = torch.randn(3, 4)
    with torch.no_grad():
        want = module(x)
    fxrewrite.optimize(module, example_inputs=((x,), {}), patterns=(GLUPattern,))
    assert "glu" in fxrewrite.explain(module).applied_patterns()
    with torch.no_grad():
        torch.testing.assert_close(module(x), want)
