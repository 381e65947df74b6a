"""transformers >= 5.25 with Hugging Face `kernels` (its dependency): `apply_rotary_pos_emb` is a module instance
calling the function and the attention class's forward is kernels' wrapper. Not kernelized, that is transformers'
own code: the rewrite looks through it (the rotary call still fuses, logits unchanged). Kernelized (a hub kernel
swapped into the instance or into an attention module's private copy) or pointing at another function, it is a
replacement and optimize refuses it, naming it. On older transformers there is nothing to see through."""

import types

import pytest
import torch
from transformers.models.qwen3 import modeling_qwen3

import fxrewrite
from fxrewrite.foreign import ForeignPatchError, foreign_patches
from fxrewrite.hub_kernels import decorated_function

from tests.e2e.tiny_models import tiny_model

pytestmark = pytest.mark.skipif(decorated_function(modeling_qwen3.apply_rotary_pos_emb) is None,
                                reason="this transformers does not apply kernels' decorators (< 5.25)")


def _hub_kernel(self, q, k, cos, sin, unsqueeze_dim=1):
    return q, k


def test_decorated_model_is_optimized_and_exact():
    stock, model = tiny_model("qwen3"), tiny_model("qwen3")
    assert foreign_patches(model) == []
    fxrewrite.optimize(model)
    applied = dict(fxrewrite.explain(model).classes["Qwen3Attention"].applied)
    assert list(applied["qk_norm_rope"]) == ["q_norm,k_norm + apply_rotary_pos_emb -> qk_norm_rope (in place, + K/V "
                                             "cache write)"]
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)


def test_the_decorated_function_reached_through_its_module_is_one_call():
    """``modeling_llama.apply_rotary_pos_emb(...)``: the instance, reached as a module attribute, is recorded as a
    call of its function (the trace stopped there, and TP=2 then refused the model for "0 linears"); its rewrite is
    refused (not a global of the forward's module), the row partner proven (a final fresh user's case)."""
    from fxrewrite.sharding import shard_model
    from tests.compiler.custom_attention import ModuleAttributeAttention, custom_llama

    model = fxrewrite.optimize(custom_llama(attention=ModuleAttributeAttention))
    report = fxrewrite.explain(model).classes["ModuleAttributeAttention"]
    assert not [why for what, why in report.skipped if what == "trace"], report.skipped
    assert shard_model(model, 0, 2)["model.layers.0.self_attn.o_proj"] == "rowwise"


def test_kernelized_private_copy_is_refused():
    model = tiny_model("qwen3")
    copy = model.model.layers[1].self_attn._kernel_funcs["rotary_pos_emb"]
    copy.forward = types.MethodType(_hub_kernel, copy)  # what kernels.kernelize does
    with pytest.raises(ForeignPatchError, match=r"apply_rotary_pos_emb is a hub kernel \(kernels\.kernelize\) \(the "
                                                r"copy of model\.layers\.1\.self_attn\)"):
        fxrewrite.optimize(model)


class _OtherRope(torch.nn.Module):
    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return q, k


@pytest.mark.parametrize("change", ["other module", "class swapped", "hook", "other function"])
def test_private_copy_changed_otherwise_is_refused(change):
    """Anything but the untouched copy: another module, its class swapped for a subclass with its own forward, a
    hook (the rewrite calls the function itself), a decorated copy of a function from elsewhere."""
    from kernels import use_kernel_forward_from_hub

    model = tiny_model("qwen3")
    attn = model.model.layers[1].self_attn
    copy = attn._kernel_funcs["rotary_pos_emb"]
    if change == "other module":
        attn._kernel_funcs["rotary_pos_emb"] = _OtherRope()
    elif change == "class swapped":
        copy.__class__ = type("Sub", (type(copy),), {"forward": _hub_kernel})
    elif change == "hook":
        copy.register_forward_hook(lambda module, args, out: out)
    else:
        attn._kernel_funcs["rotary_pos_emb"] = use_kernel_forward_from_hub("rotary_pos_emb")(_plain_rope)
    reason = {"other module": r"rotary_pos_emb is a tests\.compiler\.test_hub_kernels\._OtherRope",
              "class swapped": r"rotary_pos_emb is a .*Sub", "hook": r"apply_rotary_pos_emb has hooks",
              "other function": r"_plain_rope \(the copy of model\.layers\.1\.self_attn\) calls tests"}[change]
    with pytest.raises(ForeignPatchError, match=reason):
        fxrewrite.optimize(model)


def _plain_rope(q, k, cos, sin, unsqueeze_dim=1):
    return q, k


def test_hooked_module_level_function_is_refused():
    handle = modeling_qwen3.apply_rotary_pos_emb.register_forward_pre_hook(lambda module, args: None)
    try:
        with pytest.raises(ForeignPatchError, match=r"modeling_qwen3\.apply_rotary_pos_emb has hooks"):
            fxrewrite.optimize(tiny_model("qwen3"))
    finally:
        handle.remove()
    assert foreign_patches(tiny_model("qwen3")) == []


def test_kernelized_or_replaced_module_level_function_is_refused(monkeypatch):
    instance = modeling_qwen3.apply_rotary_pos_emb
    monkeypatch.setattr(instance, "forward", types.MethodType(_hub_kernel, instance), raising=False)
    with pytest.raises(ForeignPatchError, match=r"modeling_qwen3\.apply_rotary_pos_emb is a hub kernel"):
        fxrewrite.optimize(tiny_model("qwen3"))
    monkeypatch.undo()

    from kernels import use_kernel_forward_from_hub

    monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb",
                        use_kernel_forward_from_hub("rotary_pos_emb")(lambda q, k, cos, sin, unsqueeze_dim=1: (q, k)))
    with pytest.raises(ForeignPatchError, match=r"modeling_qwen3\.apply_rotary_pos_emb calls .*test_hub_kernels"):
        fxrewrite.optimize(tiny_model("qwen3"))


def test_wrapped_forward_of_foreign_code_is_still_refused(monkeypatch):
    """kernels' wrapper is looked through, not trusted: the function it wraps must be transformers'."""
    from kernels import use_kernelized_func

    class Patched(modeling_qwen3.Qwen3MLP):
        def forward(self, x):
            return self.down_proj(x)

    wrapped = use_kernelized_func(modeling_qwen3.apply_rotary_pos_emb)(Patched).forward
    monkeypatch.setattr(modeling_qwen3.Qwen3MLP, "forward", wrapped)
    with pytest.raises(ForeignPatchError, match=r"Qwen3MLP\.forward is .*test_hub_kernels.*Patched\.forward"):
        fxrewrite.optimize(tiny_model("qwen3"))


def test_a_custom_attention_importing_the_decorated_function_is_traced():
    """A model's own attention class (a remote-code model, say) calling the decorated instance it imported from
    a modeling file: the trace records the function as one call, as in that file, instead of stopping at the
    instance (an nn.Module fx cannot record: "not installed as a submodule"); the rotary call fuses."""
    from tests.compiler.custom_attention import custom_llama

    stock, model = custom_llama(), custom_llama()
    fxrewrite.optimize(model)
    report = fxrewrite.explain(model).classes["ImportingAttention"]
    assert not [why for what, why in report.skipped if what == "trace"], report.skipped
    assert "rotary_apply" in dict(report.applied)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)
