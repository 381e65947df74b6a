"""HF-name state dict round trip, both ways, including save_pretrained / from_pretrained."""

import sys
from pathlib import Path

import torch
import transformers as T

import fxrewrite

from tests.e2e.tiny_models import tiny_model  # noqa: E402


def _same_logits(a, b):
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=1e-5, atol=1e-6)


def test_state_dict_uses_hf_names():
    stock = tiny_model("qwen2")
    fused = fxrewrite.optimize(tiny_model("qwen2"))
    sd = fused.state_dict()
    assert set(sd) == set(stock.state_dict())
    for name, tensor in stock.state_dict().items():
        assert torch.equal(sd[name], tensor), name


def test_optimized_save_pretrained_loads_into_stock(tmp_path):
    fused = fxrewrite.optimize(tiny_model("llama", seed=3))
    fused.save_pretrained(tmp_path)
    stock = T.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    _same_logits(stock, fused)


def test_stock_checkpoint_loads_into_optimized(tmp_path):
    stock = tiny_model("mistral", seed=4)
    stock.save_pretrained(tmp_path)
    fused = fxrewrite.optimize(tiny_model("mistral", seed=5))
    reloaded = T.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    fused.load_state_dict(reloaded.state_dict())
    _same_logits(fused, stock)
    fused2 = fxrewrite.optimize(T.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval())
    _same_logits(fused2, stock)


def test_reading_a_fused_away_projection_says_where_it_went():
    import pytest

    model = fxrewrite.optimize(tiny_model("llama"))
    q_proj = model.model.layers[0].self_attn.q_proj
    assert not hasattr(q_proj, "weight")
    with pytest.raises(AttributeError, match=r"'q_proj' was fused into 'qkv_proj' .* has no 'weight'"):
        q_proj.weight
