"""The all-leaf meta tracer: shapes as values, leaves, partial graphs, untraceable modules left unchanged."""

import inspect
import operator

import torch
from torch import nn

import fxrewrite
from fxrewrite import tracer
from fxrewrite.trace_errors import error_location


class Untraceable(nn.Module):
    """Data-dependent control flow before anything fusable: the tracer cannot get past line 1."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.act = nn.Linear(4, 6), nn.Linear(4, 6), nn.SiLU()

    def forward(self, x):
        if x.sum() > 0:
            x = x * 2
        return self.act(self.gate_proj(x)) * self.up_proj(x)


class Shapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        b, s, h = x.shape
        heads = len(x.shape) + 1
        y = self.proj(x).view(*x.shape[:-1], heads, -1)
        return y.reshape(b, s, h)


def test_untraceable_module_left_unchanged_and_reported():
    module = Untraceable()
    x = torch.randn(2, 4)
    ref = module(x)
    fxrewrite.optimize(module, example_inputs=((x,), {}))
    report = fxrewrite.explain(module)
    assert report.applied_patterns() == []
    (entry,) = [r for c, p, r in report.skipped() if c == "Untraceable" and p == "trace"]
    line = inspect.getsourcelines(Untraceable.forward)[1] + 1
    assert f"test_tracer.py:{line}:" in entry and "control flow" in entry
    assert "forward" not in vars(module) and hasattr(module, "gate_proj")
    torch.testing.assert_close(module(x), ref)


def _assign_by_index():
    raise TypeError("'MetaProxy' object does not support item assignment")  # what `proxy[idx] = v` raises


def test_index_assignment_is_said_in_words_where_it_happens():
    """GPT-OSS's experts stopped the trace with "TypeError: 'MetaProxy' object does not support item assignment"
    inside transformers' MoE integration and no location (the forward is decorated, so its file is another), which
    read as an internal error; now the last frame outside torch and fxrewrite, and what the trace cannot follow."""
    try:
        _assign_by_index()
    except TypeError as e:
        error = error_location(e, nn.Identity)  # a forward in another file (torch's)
    line = inspect.getsourcelines(_assign_by_index)[1] + 1
    assert error == (f"{__file__}:{line}: the forward assigns into a tensor by index (`x[...] = ...`), "
                     "which a symbolic trace does not follow")


def test_shapes_len_unpacking_and_view_star():
    module = Shapes()
    traced = tracer.trace(module, (torch.empty(2, 3, 8, device="meta"),), {})
    assert traced.error is None
    ops = [n.target for n in traced.graph.nodes if n.op in ("call_module", "call_method")]
    assert ops == ["proj", "view", "reshape"]
    view = next(n for n in traced.graph.nodes if n.target == "view")
    assert view.args[1:] == (2, 3, 4, -1) and tuple(view.meta["val"].shape) == (2, 3, 4, 2)


def test_children_are_leaves_and_values_are_meta():
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    traced = tracer.trace(module, (torch.randn(3, 4),), {})
    calls = [n for n in traced.graph.nodes if n.op == "call_module"]
    assert [n.target for n in calls] == ["0", "1"]
    assert all(n.meta["val"].is_meta for n in calls)


def test_attention_call_is_one_leaf():
    import sys
    from pathlib import Path
    from tests.e2e.tiny_models import tiny_model

    model = tiny_model("llama")
    records, error = tracer.record_inputs(model)
    assert error is None
    attn = model.model.layers[0].self_attn
    _, args, kwargs = records[type(attn)]
    traced = tracer.trace(attn, args, kwargs)
    leaves = [n for n in traced.graph.nodes if n.target is tracer.attention]
    assert len(leaves) == 1
    assert {u.target for u in leaves[0].users} == {operator.getitem}
