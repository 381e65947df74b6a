"""Source rewriting: per-instance binding, real file line numbers, zero-argument super(), comments."""

import traceback

import torch
from torch import nn

import fxrewrite


class Base(nn.Module):
    def scale(self, x):
        return x * 2


class MLP(Base):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.act_fn = nn.Linear(4, 6), nn.Linear(4, 6), nn.SiLU()
        self.down_proj = nn.Linear(6, 4)

    def forward(self, x):
        x = super().scale(x)  # zero-argument super() must still work
        h = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        if h.shape[0] == 7:
            raise RuntimeError("boom")
        return h


def test_rewritten_forward_bound_per_instance_with_real_line_numbers():
    a, b = MLP(), MLP()
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 4)
    fxrewrite.optimize(a, example_inputs=((x,), {}))
    assert "forward" in vars(a) and "forward" not in vars(b) and hasattr(b, "gate_proj")
    torch.testing.assert_close(a(x), b(x))
    try:
        a(torch.randn(7, 4))
    except RuntimeError:
        frame = traceback.extract_tb(__import__("sys").exc_info()[2])[-1]
    assert frame.filename == __file__
    assert frame.line.strip() == 'raise RuntimeError("boom")'
    assert "# zero-argument super() must still work" in fxrewrite.explain(a).diff()
