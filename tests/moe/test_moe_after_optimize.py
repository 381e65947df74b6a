"""Hooks and router attributes set on a fused MoE block's modules after `optimize` (a fresh user's find: a hook on
the experts scaled the residual too, a hook on the router and a changed top_k / norm_topk_prob were ignored, all
silently): each is honoured as stock honours it, in the decode fold (no autograd) and in training."""

from __future__ import annotations

import copy

import pytest
import torch

import fxrewrite
from tests.moe.conftest import stock_eager, tiny_moe


def _scale_experts(m):
    m.model.layers[0].mlp.experts.register_forward_hook(lambda mod, args, out: out * 2)


def _halve_router_weights(m):
    def hook(mod, args, out):
        out = list(out)
        out[1] = out[1] * 0.5  # (logits, top-k weights, top-k ids): transformers 5's routers
        return tuple(out)
    m.model.layers[1].mlp.gate.register_forward_hook(hook)


def _top_1(m):
    m.model.layers[0].mlp.gate.top_k = 1


def _renormalize(m):
    m.model.layers[1].mlp.gate.norm_topk_prob = not m.model.layers[1].mlp.gate.norm_topk_prob


CASES = [(family, change) for family in ("qwen3_moe", "mixtral", "olmoe")
         for change in (_scale_experts, _halve_router_weights, _top_1, _renormalize)
         if not (family == "mixtral" and change is _renormalize)]  # Mixtral's router has no norm_topk_prob


@pytest.mark.parametrize(("family", "change"), CASES)
def test_a_change_after_optimize_is_honoured(family, change):
    stock = stock_eager(tiny_moe(family))
    unchanged = copy.deepcopy(stock)
    model = fxrewrite.optimize(copy.deepcopy(stock))
    change(stock), change(model)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = stock(ids).logits
        assert (want - unchanged(ids).logits).abs().max() > 1e-3  # the change moves stock's numbers
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
    model.train()(ids, labels=ids).loss.backward()
    stock.train()(ids, labels=ids).loss.backward()
    gate = "model.layers.1.mlp.gate.weight"
    torch.testing.assert_close(model.get_parameter(gate).grad, stock.get_parameter(gate).grad, rtol=1e-4, atol=1e-6)
