"""The dense decoder-layer fold ``residual add + post_attention_layernorm -> mlp gate_up + residual add``: applied
only where the gated-MLP rewrite proved the MLP's whole forward (dataflow and source) and the closing add is the
next statement; the fused path runs only without autograd, hooks or a replaced forward; outputs and gradients are
the unfused ones'."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import fxrewrite
from tests.patterns.conftest import assert_same_gradients, count_calls
from fxrewrite.layers.gated_mlp import GATED_MLP_ATTR
from fxrewrite.layers.linear import MergedColumnParallelLinear

_log = logging.getLogger(__name__)


class MLP(nn.Module):
    """transformers' LlamaMLP form."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False)
        self.down_proj, self.act_fn = nn.Linear(16, 8, bias=False), nn.SiLU()

    def forward(self, x):
        """A docstring is allowed."""
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class LoggingMLP(MLP):
    def forward(self, x):
        _log.debug("mlp")  # a statement the trace does not record
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ScaledMLP(MLP):
    def forward(self, x):
        return 0.5 * self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SwitchedMLP(MLP):
    enabled = True

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) if self.enabled else torch.zeros_like(x)


class Layer(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = LlamaRMSNorm(8), LlamaRMSNorm(8)
        self.attn, self.mlp = nn.Linear(8, 8), mlp

    def forward(self, x):
        residual = x
        x = self.input_layernorm(x)
        x = self.attn(x)
        x = residual + x
        residual = x
        x = self.post_attention_layernorm(x)
        x = self.mlp(x)
        x = residual + x
        return x


class LateAddLayer(Layer):
    def forward(self, x):
        residual = x
        x = self.attn(self.input_layernorm(x))
        x = residual + x
        residual = x
        x = self.post_attention_layernorm(x)
        x = self.mlp(x)
        x = x * 2
        x = residual + x
        return x


def _model(layer_cls=Layer, mlp_cls=MLP, n: int = 2):
    torch.manual_seed(0)
    model = nn.Sequential(*[layer_cls(mlp_cls()) for _ in range(n)])
    for p in model.parameters():
        p.data.normal_(0, 0.5)
    return model


def _optimized(layer_cls=Layer, mlp_cls=MLP):
    ref, model = _model(layer_cls, mlp_cls), _model(layer_cls, mlp_cls)
    x = torch.randn(2, 3, 8)
    fxrewrite.optimize(model, example_inputs=((x,), {}))
    return ref, model, fxrewrite.explain(model)


@pytest.fixture
def norm_forward_calls(monkeypatch):
    """How often the fused path ran (it goes through gate_up_proj's `norm_forward`)."""
    return count_calls(monkeypatch, MergedColumnParallelLinear, "norm_forward")


def test_fold_applies_and_matches(norm_forward_calls):
    ref, model, report = _optimized()
    assert "post_attention_layernorm.forward_mlp(" in report.diff()
    assert "-> mlp gate_up + residual add" in str(report)
    assert model[0].mlp.__dict__[GATED_MLP_ATTR] == ("gate_up_proj", "act_and_mul", "down_proj")
    assert model[0].mlp.gate_up_proj.gemv_prologue == "norm"
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        want, got = ref(x), model(x)
    assert len(norm_forward_calls) == 2  # one per layer: the fused path ran
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_training_takes_the_mlp_forward_and_matches_gradients(norm_forward_calls):
    ref, model, _ = _optimized()
    assert_same_gradients(ref, model, torch.randn(2, 5, 8), "gate_up_proj", ("gate_proj", "up_proj"))
    assert not norm_forward_calls


def test_a_hook_added_later_takes_the_unfused_path(norm_forward_calls):
    ref, model, _ = _optimized()
    seen = []
    model[1].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    x = torch.randn(1, 2, 8)
    with torch.no_grad():
        want, got = ref(x), model(x)
    assert len(norm_forward_calls) == 1 and seen == [torch.Size([1, 2, 8])]  # layer 0 fused, layer 1 not
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_forward_replaced_later_takes_the_unfused_path(norm_forward_calls):
    ref, model, _ = _optimized()
    mlp = model[0].mlp
    mlp.forward = lambda h: torch.zeros_like(h)  # someone else's forward: it must run
    x = torch.randn(1, 2, 8)
    with torch.no_grad():
        got = model[0](x)
        residual = x + model[0].attn(model[0].input_layernorm(x))
    assert not norm_forward_calls
    torch.testing.assert_close(got, residual)


@pytest.mark.parametrize("mlp_cls", [LoggingMLP, ScaledMLP, SwitchedMLP],
                         ids=["unseen-statement", "scaled-output", "branch-in-the-return"])
def test_mlp_not_proven_whole_keeps_its_call(mlp_cls):
    ref, model, report = _optimized(mlp_cls=mlp_cls)
    assert "glu" in report.applied_patterns() and "forward_mlp" not in report.diff()
    assert GATED_MLP_ATTR not in model[0].mlp.__dict__
    assert "x, residual = self.post_attention_layernorm(" in report.diff()  # the norm fold alone
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-6)


def test_closing_add_not_next_keeps_the_mlp_call():
    ref, model, report = _optimized(layer_cls=LateAddLayer)
    assert "forward_mlp" not in report.diff() and "x, residual = self.post_attention_layernorm(" in report.diff()
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-6)


def test_hooks_at_optimize_time_refuse_the_fold():
    ref, model = _model(), _model()
    model[0].mlp.register_forward_pre_hook(lambda m, args: None)
    x = torch.randn(2, 3, 8)
    fxrewrite.optimize(model, example_inputs=((x,), {}))
    report = fxrewrite.explain(model)
    assert any("hooks" in why for _, p, why in report.skipped() if p == "residual_rms_norm"), report.skipped()
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-6)


def test_a_hook_on_the_norm_added_later_runs(norm_forward_calls):
    ref, model, _ = _optimized()
    seen = []
    model[0].post_attention_layernorm.register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    x = torch.randn(1, 2, 8)
    with torch.no_grad():
        want, got = ref(x), model(x)
    # layer 0's norm ran as a module; its hook sees transformers' view, the normed tensor (fxrewrite.layers.residual_hooks)
    assert len(norm_forward_calls) == 1 and seen == [(1, 2, 8)]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_compiles_without_a_graph_break(norm_forward_calls):
    ref, model, _ = _optimized()
    x = torch.randn(1, 3, 8)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), ref(x), rtol=1e-5, atol=1e-6)
    assert not norm_forward_calls  # traced: the plain ops
