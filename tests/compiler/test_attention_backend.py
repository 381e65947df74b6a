"""Rewritten forwards keep the `attention_interface(...)` call: any registered attention works."""

import sys
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import fxrewrite

from tests.e2e.tiny_models import tiny_model  # noqa: E402

CALLS = []


def counting_attention(module, query, key, value, attention_mask, **kwargs):
    CALLS.append(query.shape)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def test_custom_registered_attention_is_used_after_optimize():
    AttentionInterface.register("fx_test_counting", counting_attention)
    stock = tiny_model("llama")
    fused = fxrewrite.optimize(tiny_model("llama"))
    fused.config._attn_implementation = "fx_test_counting"
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([[3, 4, 5, 9, 10, 11]])
    CALLS.clear()
    with torch.no_grad():
        out = fused(ids, position_ids=pos).logits
        ref = stock(ids, position_ids=pos).logits
    assert len(CALLS) == fused.config.num_hidden_layers
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_optimize_with_custom_attention_already_set():
    AttentionInterface.register("fx_test_counting", counting_attention)
    model = tiny_model("qwen3")
    model.config._attn_implementation = "fx_test_counting"
    fxrewrite.optimize(model)
    assert fxrewrite.explain(model).skipped() == []
    assert model.config._attn_implementation == "fx_test_counting"
