"""The fused MoE block multiplies by the routing weights in the dtype the replaced router gives them (float32 for
Mixtral, the logits' for Qwen3-MoE / OLMoE / Qwen2-MoE, the input's for Granite-MoE): in bf16 and under bf16
autocast its logits equal transformers' eager experts bit for bit (they kept float32 weights: an ulp off, and greedy
generation diverged)."""

from __future__ import annotations

import copy

import pytest
import torch

import fxrewrite
from fxrewrite.layers.fused_moe import FusedMoE
from tests.moe.conftest import FAMILIES, stock_eager, tiny_moe

KINDS = {"mixtral": "float32", "qwen3_moe": "logits", "olmoe": "logits", "qwen2_moe": "logits", "granitemoe": "input"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("mode", ["bf16", "autocast"])
def test_bf16_logits_equal_stock_eager_experts(family, mode):
    model = tiny_moe(family)
    ref = stock_eager(copy.deepcopy(model))
    fxrewrite.optimize(model)
    assert {m.weights_dtype for m in model.modules() if isinstance(m, FusedMoE)} == {KINDS[family]}
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    if mode == "bf16":
        model.to(torch.bfloat16)
        ref.to(torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        got, want = model(ids).logits, ref(ids).logits
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()


def test_generate_in_bf16_matches_stock_eager_experts():
    model = tiny_moe("qwen3_moe")
    ref = stock_eager(copy.deepcopy(model)).to(torch.bfloat16)
    fxrewrite.optimize(model).to(torch.bfloat16)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))


def test_router_rounding_its_weights_otherwise_is_refused():
    """A router of our own that rounds its routing weights to float16 whatever the input: not a dtype the fused
    block reproduces, so the block stays as it was and explain says why."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as mod

    def forward(self, hidden_states):
        logits, weights, ids = mod.Qwen3MoeTopKRouter.forward(self, hidden_states)
        return logits, weights.to(torch.float16), ids

    variant = type("HalfWeightsRouter", (mod.Qwen3MoeTopKRouter,), {"forward": forward})
    model = tiny_moe("qwen3_moe")
    for module in model.modules():
        if type(module) is mod.Qwen3MoeTopKRouter:
            module.__class__ = variant
    fxrewrite.optimize(model)
    assert not any(isinstance(m, FusedMoE) for m in model.modules())
    assert "routing weights are torch.float16 for bf16 input" in str(fxrewrite.explain(model))
