"""optimize() with what training code already has: optimizer state in HF order, foreign patches, PEFT LoRA."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.e2e.tiny_models import tiny_model

import fxrewrite
from fxrewrite.foreign import ForeignPatchError
from fxrewrite.optimizer_state import optimizer_state_dict


def _train_steps(model, opt, steps=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(3, 96, (2, 8), generator=gen)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("named", [False, True])
def test_optimizer_state_round_trip_continues_like_stock(named):
    stock = tiny_model("qwen2").train()
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    params = (lambda m: list(m.named_parameters())) if named else (lambda m: list(m.parameters()))
    opt_stock = torch.optim.AdamW(params(stock), lr=1e-2)
    _train_steps(stock, opt_stock)
    fused.load_state_dict(stock.state_dict())  # HF names merge into the fused parameters
    opt_fused = torch.optim.AdamW(params(fused), lr=1e-2)
    opt_fused.load_state_dict(optimizer_state_dict(fused, opt_stock.state_dict(), to="fused"))
    _train_steps(stock, opt_stock, seed=1)
    _train_steps(fused, opt_fused, seed=1)
    for name, p in fused.state_dict().items():
        torch.testing.assert_close(p, stock.state_dict()[name], rtol=1e-4, atol=1e-5)
    back = optimizer_state_dict(fused, opt_fused.state_dict(), to="hf")
    want = opt_stock.state_dict()
    assert len(back["state"]) == len(want["state"])
    for i, entry in want["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(back["state"][i][key], value, rtol=1e-4, atol=1e-6)
    if named:
        assert back["param_groups"][0]["param_names"] == want["param_groups"][0]["param_names"]


def test_optimizer_state_bad_arguments():
    fused = fxrewrite.optimize(tiny_model("llama"))
    with pytest.raises(ValueError, match="'fused' or 'hf'"):
        optimizer_state_dict(fused, {}, to="stock")
    with pytest.raises(ValueError, match="not been passed through"):
        optimizer_state_dict(tiny_model("llama"), {"state": {}, "param_groups": []}, to="hf")
    opt = torch.optim.AdamW(fused.parameters(), lr=1e-2)
    _train_steps(fused, opt, steps=1)
    with pytest.raises(ValueError, match=r"state of 'model.*': exp_avg has shape .* to='fused' reads a state dict "
                                         r"of the hf view \(the stock model's optimizer\)"):
        optimizer_state_dict(fused, opt.state_dict(), to="fused")  # already fused: the wrong way round
    stock = tiny_model("llama")
    stock_opt = torch.optim.AdamW(stock.parameters(), lr=1e-2)
    _train_steps(stock, stock_opt, steps=1)
    with pytest.raises(ValueError, match=r"more parameters than the model's fused view has .* state dict of the "
                                         r"optimized model's optimizer"):
        optimizer_state_dict(fused, stock_opt.state_dict(), to="hf")  # an HF-order state: the wrong way round


def test_unnamed_weight_decay_groups_get_an_error_naming_the_fix():
    """Trainer-style groups (matrices decayed, vectors not) without param_names cannot be mapped to names: the error
    says so and how to build the optimizer instead, not only that the state might be the other view's."""
    stock = tiny_model("qwen2")
    fused = fxrewrite.optimize(copy.deepcopy(stock))
    opt = torch.optim.AdamW([{"params": [p for p in stock.parameters() if p.dim() > 1], "weight_decay": 0.1},
                             {"params": [p for p in stock.parameters() if p.dim() <= 1], "weight_decay": 0.0}])
    _train_steps(stock, opt, steps=1)
    with pytest.raises(ValueError, match=r"exp_avg has shape .* or its 2 param groups do not list the parameters in "
                                         r"named_parameters\(\) order .* from model\.named_parameters\(\)"):
        optimizer_state_dict(fused, opt.state_dict(), to="fused")


def test_foreign_patch_of_a_module_function_is_refused(monkeypatch):
    from transformers.models.llama import modeling_llama

    def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return q, k

    liger_rotary_pos_emb.__module__ = "liger_kernel.transformers.rope"
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", liger_rotary_pos_emb)
    with pytest.raises(ForeignPatchError, match=r"modeling_llama\.apply_rotary_pos_emb is liger_kernel"):
        fxrewrite.optimize(tiny_model("llama"))


def test_foreign_patch_of_a_class_forward_is_refused(monkeypatch):
    from transformers.models.qwen3 import modeling_qwen3

    def lce_forward(self, *args, **kwargs):
        raise AssertionError("not called")

    lce_forward.__module__ = "liger_kernel.transformers.model.qwen3"
    monkeypatch.setattr(modeling_qwen3.Qwen3ForCausalLM, "forward", lce_forward)
    with pytest.raises(ForeignPatchError, match="Qwen3ForCausalLM.forward is liger_kernel"):
        fxrewrite.optimize(tiny_model("qwen3"))


def test_foreign_instance_forward_is_refused():
    model = tiny_model("llama")

    class LigerRMSNorm(torch.nn.Module):
        def forward(self, x):
            return x

    LigerRMSNorm.__module__ = "liger_kernel.transformers.rms_norm"
    norm = model.model.norm
    norm.forward = LigerRMSNorm.forward.__get__(norm)
    with pytest.raises(ForeignPatchError, match="LlamaRMSNorm.forward of this instance"):
        fxrewrite.optimize(model)


def test_fused_away_children_name_the_fix():
    fused = fxrewrite.optimize(tiny_model("llama"))
    attn = fused.model.layers[0].self_attn
    assert "was fused into 'qkv_proj'" in repr(attn.q_proj) and "get_peft_model first" in repr(attn.q_proj)
    assert not list(attn.q_proj.parameters())
    assert "model.layers.0.self_attn.q_proj.weight" in fused.state_dict()  # HF names unchanged


LORA_TARGETS = ["q_proj", "v_proj"]


def test_optimize_of_a_peft_model_trains_like_it():
    import peft  # the `train` / `dev` extras install it
    config = peft.LoraConfig(r=4, target_modules=LORA_TARGETS, lora_dropout=0.0, init_lora_weights=False)
    stock = peft.get_peft_model(tiny_model("llama"), config).train()
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    attn = fused.base_model.model.model.layers[0].self_attn
    assert type(attn.q_proj).__module__.startswith("peft.")  # the adapters are kept: q/k/v stay unfused
    assert "lm_head_loss" in fxrewrite.explain(fused).applied_patterns()
    ids = torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    grads = []
    for model in (stock, fused):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert set(grads[0]) == set(grads[1]) and any("lora_A" in n for n in grads[0])
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7)


def test_explain_says_which_projections_lora_keeps_unfused():
    """fresh-8 F9: the glu and qkv rows had no reason when PEFT wrapped q_proj / v_proj / gate_proj."""
    import peft  # the `train` / `dev` extras install it
    config = peft.LoraConfig(r=4, target_modules=[*LORA_TARGETS, "gate_proj"], lora_dropout=0.0)
    report = fxrewrite.explain(fxrewrite.optimize(peft.get_peft_model(tiny_model("llama"), config)))
    skipped = {(cls, pattern): reason for cls, pattern, reason in report.skipped()}
    glu, qkv = skipped[("LlamaMLP", "glu")], skipped[("LlamaAttention", "qkv")]
    # every layer wrapped alike: one structure group per class (PEFT's per-layer `kwargs` record is not structure),
    # so one trace and one reason per class, no instance names
    assert glu == "gate_proj is LoRA-wrapped (peft Linear around nn.Linear): gate/up kept unfused"
    assert "q_proj is LoRA-wrapped" in qkv and "v_proj is LoRA-wrapped" in qkv and "k_proj" not in qkv
    assert "layers.0" not in str(report) and "qkv" not in report.applied_patterns()
    # the wrapper's own row says what it is (it said "not called during the meta run", a fresh user's puzzle)
    assert skipped[("LoraModel", "trace")].startswith("a PEFT wrapper, not traced")


@pytest.mark.parametrize("targets", [LORA_TARGETS, "all-linear"])
def test_peft_on_an_optimized_model_names_the_module_and_the_fix(targets):
    """Named targets, and PEFT's "all-linear" (TRL's common setting, applied after the user's optimize), which picks
    modules by type: before, it adapted only o_proj and down_proj, silently (a fresh user found it)."""
    import peft  # the `train` / `dev` extras install it
    fused = fxrewrite.optimize(tiny_model("llama"))
    with pytest.raises(ValueError, match=r"'q_proj' was fused into 'qkv_proj'.*get_peft_model first"):
        peft.get_peft_model(fused, peft.LoraConfig(r=4, target_modules=targets))
    attn = fused.model.layers[0].self_attn
    assert not hasattr(attn.q_proj, "in_features")  # an AttributeError too: hasattr and getattr defaults still work
    adapted = peft.get_peft_model(fxrewrite.optimize(tiny_model("llama")), peft.LoraConfig(r=4, target_modules=["o_proj"]))
    assert {n.rsplit(".", 2)[-2] for n, _ in adapted.named_modules() if n.endswith("lora_A")} == {"o_proj"}


def test_back_to_sdpa_after_optimize_for_context_parallelism():
    """transformers' Trainer refuses context parallelism unless ``_attn_implementation == "sdpa"``; the README's fix
    (``set_attn_implementation("sdpa")`` after optimize) keeps every fusion and the stock numbers."""
    stock = tiny_model("qwen3")
    fused = fxrewrite.optimize(copy.deepcopy(stock))
    applied = fxrewrite.explain(fused).applied_patterns()
    assert fused.config._attn_implementation == "fxrewrite_sdpa"
    fused.set_attn_implementation("sdpa")
    assert fused.config._attn_implementation == "sdpa"
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)
    assert fxrewrite.explain(fused).applied_patterns() == applied
    (note,) = [n for n in fxrewrite.explain(fused).notes if n.startswith("attention: ")]
    assert note.startswith("attention: fxrewrite_sdpa (") and note.endswith("; now 'sdpa', set after optimize")
    fused.set_attn_implementation("fxrewrite_sdpa")  # back: the note as optimize wrote it
    assert not [n for n in fxrewrite.explain(fused).notes if n.endswith("set after optimize")]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_torch_func_grad_and_per_sample_grads_match_stock(arch):
    """torch.func.grad and vmap(grad) (per-sample gradients) through an optimized model with labels: the fused
    layers take their torch references under functorch (their autograd Functions are in the ctx-in-forward form it
    refuses: "must override the setup_context staticmethod", a fresh user's find); gradients as stock's, float32."""
    from torch.func import functional_call, grad, vmap

    from fxrewrite.weights import to_hf_names

    stock = tiny_model(arch).train()
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    ids = torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(1))

    def loss(model):
        return lambda params, x: functional_call(model, params, (), {"input_ids": x, "labels": x}).loss

    def params(model):
        return {n: p.detach() for n, p in model.named_parameters()}

    want = grad(loss(stock))(params(stock), ids)
    got = to_hf_names(fused, grad(loss(fused))(params(fused), ids))
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=name)
    one = lambda model: (lambda p, x: loss(model)(p, x[None]))  # noqa: E731
    want = vmap(grad(one(stock)), in_dims=(None, 0))(params(stock), ids)
    per = to_hf_names(fused, vmap(grad(one(fused)), in_dims=(None, 0))(params(fused), ids))  # [B, *shape] kept
    for name, w in want.items():
        torch.testing.assert_close(per[name], w, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match=r"to_hf_names: 'model.layers.0.self_attn.qkv_proj.weight' has shape"):
        to_hf_names(fused, {"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(3)})


def test_trainer_weight_decay_groups_convert_with_param_names():
    """A stock Trainer's optimizer.pt (decay / no-decay groups, no param_names): converted with `param_names` from
    transformers' own rule (`Trainer.get_decay_parameter_names`), it loads into the optimizer Trainer builds for the
    optimized model, and training continues as the stock run does (a fresh user's find)."""
    from transformers import Trainer

    def groups(model):
        decay = set(Trainer.get_decay_parameter_names(None, model))  # `self` unused: transformers' rule itself
        named = list(model.named_parameters())
        return [[n for n, _ in named if n in decay], [n for n, _ in named if n not in decay]]

    def adamw(model, names):
        params = dict(model.named_parameters())
        return torch.optim.AdamW([{"params": [params[n] for n in names[0]], "weight_decay": 0.1},
                                  {"params": [params[n] for n in names[1]], "weight_decay": 0.0}], lr=1e-2)

    stock = tiny_model("qwen2").train()
    stock_names = groups(stock)
    stock_opt = adamw(stock, stock_names)
    _train_steps(stock, stock_opt, steps=2)
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    fused_opt = adamw(fused, groups(fused))
    fused_opt.load_state_dict(optimizer_state_dict(fused, stock_opt.state_dict(), to="fused",
                                                   param_names=stock_names))
    _train_steps(stock, stock_opt, steps=2, seed=1)
    _train_steps(fused, fused_opt, steps=2, seed=1)
    for name, value in fused.state_dict().items():
        torch.testing.assert_close(value, stock.state_dict()[name], rtol=1e-4, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match=r"param_names must list each of the state dict's 2 param groups"):
        optimizer_state_dict(fused, stock_opt.state_dict(), to="fused", param_names=stock_names[:1])
    k = "model.layers.0.self_attn.k_proj.weight"  # one part of qkv_proj in the other group: refused, naming it
    split = [[n for n in stock_names[0] if n != k], [*stock_names[1], k]]
    with pytest.raises(ValueError, match=rf"and '{k}' \(param group 1\) are parts of the optimized model's "
                                         r"'model.layers.0.self_attn.qkv_proj.weight', one parameter"):
        optimizer_state_dict(fused, adamw(stock, split).state_dict(), to="fused", param_names=split)
