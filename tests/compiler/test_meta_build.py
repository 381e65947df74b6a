"""The engine's path: build on meta (buffers real), optimize, materialise, load HF weights by name."""

import sys
from pathlib import Path

import pytest
import torch
import transformers as T
from accelerate import init_empty_weights

import fxrewrite
from fxrewrite.runtime.model_files.loader import materialize
from fxrewrite.weights import load_hf_weights

from tests.e2e.tiny_models import tiny_config, tiny_model  # noqa: E402


@pytest.mark.parametrize("arch", ["llama", "gemma2", "phi3"])
def test_meta_build_then_load(arch):
    stock = tiny_model(arch)
    with init_empty_weights(include_buffers=False):
        model = T.AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    model.eval()
    fxrewrite.optimize(model)
    report = fxrewrite.explain(model)
    assert "rotary" in report.applied_patterns() and report.skipped() == []
    assert all(p.is_meta for p in model.parameters())
    materialize(model, torch.device("cpu"))
    loaded = load_hf_weights(model, stock.state_dict().items())
    assert set(dict(model.named_parameters())) <= loaded
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([[0, 1, 2, 3, 10, 11, 12, 13, 14]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids, position_ids=pos).logits, stock(ids, position_ids=pos).logits,
                                   rtol=1e-5, atol=1e-5)


def test_load_hf_weights_routes_shards():
    stock = tiny_model("qwen2")  # q/k/v biases too
    fused = fxrewrite.optimize(tiny_model("qwen2", seed=1))
    loaded = load_hf_weights(fused, stock.state_dict().items())
    attn = fused.model.layers[0].self_attn
    assert "model.layers.0.self_attn.qkv_proj.bias" in loaded
    ref = stock.model.layers[0].self_attn
    torch.testing.assert_close(attn.qkv_proj.bias, torch.cat([ref.q_proj.bias, ref.k_proj.bias, ref.v_proj.bias]))
