"""HF-name state dict round trip, both ways, including save_pretrained / from_pretrained."""

import copy
import sys
from pathlib import Path

import pytest
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
    with pytest.raises(AttributeError, match=r"FusedAway\(q_proj -> qkv_proj, fxrewrite.optimize\) has no attribute"):
        model.get_parameter("model.layers.0.self_attn.q_proj.weight")
    # freezing it after optimize had frozen nothing, silently (a fresh user's find)
    qkv = model.model.layers[0].self_attn.qkv_proj
    for flag in (False, True):
        q_proj.requires_grad_(not flag)  # qkv_proj agrees already: nothing to set
        with pytest.raises(ValueError, match=rf"q_proj.requires_grad_\({flag}\): .*fused into 'qkv_proj'.*before"):
            q_proj.requires_grad_(flag)
        qkv.requires_grad_(flag)
    assert all(p.requires_grad for p in model.parameters())
    for module in model.modules():  # freezing everything module by module: the parent came first, nothing to say
        module.requires_grad_(False)
    assert not any(p.requires_grad for p in model.parameters())
    copy.deepcopy(model).model.layers[0].self_attn.q_proj.requires_grad_(False)  # the copy's own parent


def _moved(state: dict, keep) -> dict:
    return {k: v + 0.5 for k, v in state.items() if keep(k)}


def test_partial_state_dict_loads_like_stock():
    """load_state_dict of a partial dict (LoRA deltas merged into q_proj / v_proj only, an empty dict) loads the parts
    it has and reports the others missing under their HF names, as for a stock model (strict or not)."""
    import pytest

    stock, fused = tiny_model("qwen2"), fxrewrite.optimize(tiny_model("qwen2"))
    for state in (_moved(stock.state_dict(), lambda k: "q_proj" in k or "v_proj" in k or "up_proj" in k), {}):
        want, got = stock.load_state_dict(state, strict=False), fused.load_state_dict(state, strict=False)
        assert (sorted(got.missing_keys), got.unexpected_keys) == (sorted(want.missing_keys), want.unexpected_keys)
        assert {k: torch.equal(v, stock.state_dict()[k]) for k, v in fused.state_dict().items()} == \
            {k: True for k in stock.state_dict()}
        _same_logits(fused, stock)
    with pytest.raises(RuntimeError) as want:
        stock.load_state_dict(_moved(stock.state_dict(), lambda k: "k_proj.bias" not in k))
    with pytest.raises(RuntimeError) as got:
        fused.load_state_dict(_moved(stock.state_dict(), lambda k: "k_proj.bias" not in k))
    assert str(got.value).replace("Qwen2ForCausalLM", "") == str(want.value).replace("Qwen2ForCausalLM", "")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_state_dict_keys_come_in_the_stock_order(arch):
    """Not only the same keys: the same order (q/k/v before o_proj, gate/up before down_proj), as code that walks
    a state dict alongside the stock model's expects."""
    stock = tiny_model(arch)
    fused = fxrewrite.optimize(copy.deepcopy(stock))
    assert list(fused.state_dict()) == list(stock.state_dict())
    wrapped = torch.nn.ModuleDict({"policy": fused})  # under a prefix too
    assert list(wrapped.state_dict()) == [f"policy.{k}" for k in stock.state_dict()]


@pytest.mark.parametrize("writer", ["accelerate", "safetensors"])
def test_checkpoint_writers_that_group_by_storage_keep_every_part(tmp_path, writer):
    """q / k / v (gate / up) are rows of one fused parameter; a writer that drops tensors sharing a storage
    (accelerate's save_model keeps one name per storage, safetensors' save_model refuses) must still write every
    part: the state dict's parts alias the parameter without sharing its storage object. The folder loads into stock
    transformers with the optimized model's logits; writes through a part still reach the parameter."""
    fused = fxrewrite.optimize(tiny_model("qwen3", seed=6))
    if writer == "accelerate":
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        try:
            Accelerator(cpu=True).save_model(fused, tmp_path)
        finally:
            AcceleratorState._reset_state(True)  # a process-wide singleton: leave none behind for other tests
    else:
        from safetensors.torch import save_model

        save_model(fused, str(tmp_path / "model.safetensors"))
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "model.safetensors")
    assert set(saved) == set(fused.state_dict()), set(fused.state_dict()) - set(saved)
    fused.config.save_pretrained(tmp_path)
    stock = T.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    _same_logits(stock, fused.eval())
    part = fused.state_dict()["model.layers.0.self_attn.k_proj.weight"]
    part.zero_()
    assert not fused.model.layers[0].self_attn.qkv_proj.weight.detach().abs().sum(dim=1).bool().all()


def test_state_dict_keep_vars_keeps_the_autograd_link():
    fused = fxrewrite.optimize(tiny_model("llama"))
    part = fused.state_dict(keep_vars=True)["model.layers.0.self_attn.v_proj.weight"]
    assert part.requires_grad and part.grad_fn is not None
