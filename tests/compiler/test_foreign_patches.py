"""Replaced modeling code (review F2): every way of replacing transformers code that the rewrite would drop is
refused with a ForeignPatchError naming it, whatever `__module__` the replacement carries (functools.wraps
copies the wrapped one's); stock models are not refused; a forward replaced on a plain torch child keeps the
module whose fusion would drop it unfused. Liger-named patches: tests/e2e/test_training_interop.py."""

import functools
import types

import pytest
import torch
from transformers.models.llama import modeling_llama

import fxrewrite
from fxrewrite.foreign import ForeignPatchError, foreign_patches

from tests.e2e.tiny_models import ARCHS, tiny_model


def _own(self, x):
    return self.down_proj(x)


_STOCK_MLP_FORWARD = modeling_llama.LlamaMLP.forward


@functools.wraps(_STOCK_MLP_FORWARD)
def _logged(self, x):  # a user's wrapper (logging, say) that the rewrite, reading the unwrapped source, would drop
    return _STOCK_MLP_FORWARD(self, x)


_INSTANCE = {
    "function": (lambda mlp: _own.__get__(mlp), r"is tests\.compiler\.test_foreign_patches\._own"),
    "lambda": (lambda mlp: (lambda x: x), r"is tests\.compiler\.test_foreign_patches\..*<lambda>"),
    "MethodType of another transformers function": (
        lambda mlp: types.MethodType(modeling_llama.LlamaRMSNorm.forward, mlp), r"is transformers\..*LlamaRMSNorm"),
    "functools.partial": (lambda mlp: functools.partial(_own, mlp), "is functools.partial of tests"),
    "functools.wraps wrapper": (lambda mlp: types.MethodType(_logged, mlp), "is a wrapper defined at .*test_foreign"),
}


@pytest.mark.parametrize("kind", sorted(_INSTANCE))
def test_instance_forward_replacements_are_refused(kind):
    model = tiny_model("llama")
    make, origin = _INSTANCE[kind]
    mlp = model.model.layers[0].mlp
    mlp.forward = make(mlp)
    with pytest.raises(ForeignPatchError, match=r"LlamaMLP\.forward of this instance \(model\.layers\.0\.mlp\) "
                                                + origin):
        fxrewrite.optimize(model)
    assert not hasattr(model, "_fxrewrite_report")


def test_wrapped_module_function_and_class_forward_are_refused(monkeypatch):
    """functools.wraps keeps `__module__`, so only the code's file tells; before, both were accepted and the
    rewrite (which reads the unwrapped source) silently dropped the wrapper."""
    stock_rope = modeling_llama.apply_rotary_pos_emb

    @functools.wraps(stock_rope)
    def logged_rope(*args, **kwargs):
        return stock_rope(*args, **kwargs)

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", logged_rope)
    with pytest.raises(ForeignPatchError, match=r"modeling_llama\.apply_rotary_pos_emb is a wrapper defined at "
                                                r".*test_foreign_patches\.py"):
        fxrewrite.optimize(tiny_model("llama"))
    monkeypatch.undo()
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", _logged)
    with pytest.raises(ForeignPatchError, match=r"modeling_llama\.LlamaMLP\.forward is a wrapper defined at"):
        fxrewrite.optimize(tiny_model("llama"))


def test_replaced_torch_class_forward_is_refused(monkeypatch):
    """A fused layer no longer calls nn.Linear.forward: a patch of it would silently stop applying to q/k/v."""
    stock_linear = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: stock_linear(self, x))
    with pytest.raises(ForeignPatchError, match=r"torch\.nn\.modules\.linear\.Linear\.forward is tests\."):
        fxrewrite.optimize(tiny_model("llama"))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_stock_models_are_not_refused(arch):
    model = tiny_model(arch)
    assert foreign_patches(model) == []
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    mlp = model.model.layers[0].mlp
    mlp.forward = type(mlp).forward.__get__(mlp)  # the class's own forward, as accelerate's remove_hook leaves it
    assert foreign_patches(model) == []


def test_forward_replaced_on_a_torch_child_keeps_its_parent_unfused():
    """Before, q_proj's own forward was dropped silently when q/k/v were fused."""
    stock = tiny_model("llama")
    q_proj = stock.model.layers[0].self_attn.q_proj
    q_proj.forward = lambda x: torch.nn.functional.linear(x, q_proj.weight) * 0.5
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = stock(ids).logits
    fxrewrite.optimize(stock)
    assert not hasattr(stock.model.layers[0].self_attn, "qkv_proj")
    assert hasattr(stock.model.layers[1].self_attn, "qkv_proj")
    reasons = dict(fxrewrite.explain(stock).classes["LlamaAttention"].skipped)
    assert reasons["qkv"] == ("[model.layers.0.self_attn] the forward of child 'q_proj' (or of a module in it) is "
                              "replaced on the instance and would be lost by the fusion; left as it is")
    with torch.no_grad():
        torch.testing.assert_close(stock(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_a_model_offloaded_by_accelerate_is_refused_naming_accelerate(tmp_path):
    """A device_map with CPU / disk offload runs modules through accelerate's hooks (which move weights at call
    time): refused saying so and what to do, not as a foreign patch of Qwen3Attention.forward (a fresh user's
    find)."""
    from transformers import AutoModelForCausalLM

    tiny_model("qwen3").save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
                  "lm_head": "cpu", "model.rotary_emb": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                 offload_folder=tmp_path / "offload")
    with pytest.raises(ForeignPatchError, match=r"refuses a model dispatched by accelerate \(\d+ modules run through "
                                                r"its hooks, e\.g\. .*\)\: a device_map that offloads.*Load the model "
                                                "onto one device"):
        fxrewrite.optimize(model)
