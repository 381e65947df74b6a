"""Weights shared across layers (ALBERT / MobileLLM style): a fusion that copies a shared projection would untie it
(fresh-user report: the shared gate's gradient lost layer 1's share, rel. diff 0.98, and the model drifted from stock
after one SGD step). Such a projection now stays unfused, with the reason in `explain`; a module shared as a whole
(one decoder layer called twice) is still rewritten, once."""

import copy

import pytest
import torch

import fxrewrite

from tests.e2e.tiny_models import tiny_model
from tests.moe.conftest import tiny_moe


def _share(model, how: str) -> str:
    first, second = model.model.layers[0], model.model.layers[1]
    if how == "gate module":
        second.mlp.gate_proj = first.mlp.gate_proj
        return "glu: gate_proj is also model.layers.1.mlp.gate_proj (shared weights)"
    if how == "up parameter":
        second.mlp.up_proj.weight = first.mlp.up_proj.weight
        return "glu: up_proj.weight is also model.layers.1.mlp.up_proj.weight (shared weights)"
    second.self_attn.v_proj = first.self_attn.v_proj
    return "qkv: v_proj is also model.layers.1.self_attn.v_proj (shared weights)"


def _train_step(model, ids):
    model.train()
    model(ids, labels=ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    with torch.no_grad():
        return model.eval()(ids).logits


@pytest.mark.parametrize("how", ["gate module", "up parameter", "v module"])
def test_a_shared_projection_stays_unfused_and_trains_as_stock(how):
    stock = tiny_model("llama")
    reason = _share(stock, how)
    model = fxrewrite.optimize(copy.deepcopy(stock))
    assert reason in str(fxrewrite.explain(model))
    assert model.num_parameters() == stock.num_parameters()
    ids = torch.randint(3, stock.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_train_step(model, ids), _train_step(stock, ids), rtol=1e-5, atol=1e-5)
    first, second = model.model.layers[0], model.model.layers[1]
    name = {"gate module": "mlp.gate_proj", "up parameter": "mlp.up_proj", "v module": "self_attn.v_proj"}[how]
    assert first.get_submodule(name).weight is second.get_submodule(name).weight  # still one tensor


def test_a_layer_shared_as_a_whole_is_rewritten_once():
    stock = tiny_model("llama", num_hidden_layers=2)
    stock.model.layers[1] = stock.model.layers[0]
    model = fxrewrite.optimize(copy.deepcopy(stock))
    layers = model.model.layers
    assert layers[0] is layers[1]
    assert hasattr(layers[0].mlp, "gate_up_proj") and hasattr(layers[0].self_attn, "qkv_proj")
    ids = torch.randint(3, stock.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_train_step(model, ids), _train_step(stock, ids), rtol=1e-5, atol=1e-5)


def test_shared_experts_keep_their_block_unfused():
    stock = tiny_moe("qwen3_moe")
    stock.model.layers[1].mlp.experts = stock.model.layers[0].mlp.experts
    model = fxrewrite.optimize(copy.deepcopy(stock))
    assert "moe: experts is also model.layers.1.mlp.experts (shared weights)" in str(fxrewrite.explain(model))
    assert model.model.layers[0].mlp.experts is model.model.layers[1].mlp.experts
    assert model.num_parameters() == stock.num_parameters()


@pytest.mark.parametrize("how", ["norm weight across layers", "norm under two names", "k_norm is q_norm"])
def test_shared_norms_stay_shared(how):
    """Final fresh user: a norm weight shared by two norms was copied into two fused norms, and a norm module under
    two names of one layer was replaced under the first name only (torch's named_children lists it once)."""
    stock = tiny_model("qwen3")
    first, second = stock.model.layers[0], stock.model.layers[1]
    if how == "norm weight across layers":
        second.post_attention_layernorm.weight = first.post_attention_layernorm.weight
    elif how == "norm under two names":
        first.post_attention_layernorm = first.input_layernorm
    else:
        first.self_attn.k_norm = first.self_attn.q_norm
    model = fxrewrite.optimize(copy.deepcopy(stock))
    assert model.num_parameters() == stock.num_parameters()
    ids = torch.randint(3, stock.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_train_step(model, ids), _train_step(stock, ids), rtol=1e-5, atol=1e-5)


def test_one_projection_under_two_names_is_refused_naming_both():
    """k_proj = q_proj in one attention (MHA): the refusal was a confusing 'build failed: AttributeError'."""
    stock = tiny_model("qwen3", num_attention_heads=4, num_key_value_heads=4)
    attn = stock.model.layers[0].self_attn
    attn.k_proj = attn.q_proj
    model = fxrewrite.optimize(copy.deepcopy(stock))
    assert "q_proj is also k_proj of the same module (shared weights)" in str(fxrewrite.explain(model))
    ids = torch.randint(3, stock.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(_train_step(model, ids), _train_step(stock, ids), rtol=1e-5, atol=1e-5)
