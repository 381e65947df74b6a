"""Training with optimize(): loss and every parameter gradient equal to stock transformers (float32, CPU),
through the Triton training kernels (interpreter) and the fused linear cross-entropy."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.e2e.tiny_models import tiny_model

import fxrewrite
from fxrewrite.benchmarks.train import enable_checkpointing
from fxrewrite.kernels.triton_utils import interpreter_ready
from fxrewrite.weights import to_hf_names

ARCHS = ["llama", "qwen2", "qwen3", "gemma2", "phi3"]
pytestmark = pytest.mark.slow  # runs first under xdist (tests/conftest.py)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _step(model, ids, labels, **kwargs):
    model.zero_grad()
    out = model(ids, labels=labels, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _batch(seed=4):
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, :3] = -100  # prompt tokens masked out
    return ids, labels


def assert_same_training_step(stock, fused, ids, labels, **kwargs):
    want, want_grads = _step(stock, ids, labels, **kwargs)
    got, got_grads = _step(fused, ids, labels, **kwargs)
    got_loss, want_loss = float(got.loss.detach()), float(want.loss.detach())
    assert abs(got_loss - want_loss) <= 1e-6 * abs(want_loss)
    hf = to_hf_names(fused, got_grads)
    assert set(hf) == set(want_grads)
    for name, g in want_grads.items():
        assert _rel(hf[name], g) < 1e-5, name
    return got


@pytest.mark.parametrize("arch", ARCHS)
def test_loss_and_grads_match_stock(arch, monkeypatch):
    assert interpreter_ready(), "tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported"
    monkeypatch.setenv("FXREWRITE_TRITON", "1")  # the Triton training kernels, in the interpreter
    stock = tiny_model(arch).train()
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    assert "lm_head_loss" in fxrewrite.explain(fused).applied_patterns()
    out = assert_same_training_step(stock, fused, *_batch())
    assert out.logits is None  # the fused loss path never builds the logits


def test_default_model_tiny_config_matches_stock(tiny_model_dir):
    import transformers

    config = transformers.AutoConfig.from_pretrained(tiny_model_dir("llama"))
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    ids = torch.randint(3, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    assert_same_training_step(stock, fused, ids, ids.clone())


def test_num_items_in_batch_and_shift_labels():
    stock = tiny_model("qwen3").train()
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    ids, labels = _batch()
    assert_same_training_step(stock, fused, ids, labels, num_items_in_batch=torch.tensor(23))
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    assert_same_training_step(stock, fused, ids, labels, shift_labels=shift)


@pytest.mark.parametrize("arch,overrides", [("llama", {"tie_word_embeddings": True}),
                                            ("gemma2", {"final_logit_softcapping": 2.0})])
def test_tied_embeddings_and_softcapping(arch, overrides):
    stock = tiny_model(arch, **overrides).train()
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    assert_same_training_step(stock, fused, *_batch())


def test_logits_returned_without_labels_or_in_eval():
    stock = tiny_model("llama")
    fused = fxrewrite.optimize(copy.deepcopy(stock))
    ids, labels = _batch()
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)
        out = fused.eval()(ids, labels=labels)  # eval: the stock path, logits and loss both
        torch.testing.assert_close(out.logits, stock.eval()(ids).logits, rtol=1e-5, atol=1e-5)
        assert abs(float(out.loss) - float(stock(ids, labels=labels).loss)) < 1e-6
    fused.train()
    assert fused(ids, labels=labels).logits is None


def test_bad_labels_raise_the_stock_error():
    stock = tiny_model("llama").train()
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    ids, _ = _batch()
    for labels in (ids[:, :5], ids.float(), ids.int(), ids > 50):  # int32 / bool: cross-entropy's dtype error
        with pytest.raises(Exception) as want:
            stock(ids, labels=labels)
        with pytest.raises(type(want.value)) as got:
            fused(ids, labels=labels)
        assert str(got.value) == str(want.value)


def test_custom_loss_function_is_respected():
    fused = fxrewrite.optimize(tiny_model("llama")).train()
    fused.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().mean() * 0 + 42.0
    ids, labels = _batch()
    out = fused(ids, labels=labels)
    assert float(out.loss) == 42.0 and out.logits is not None


@pytest.mark.parametrize("when", ["before", "after", "triton"])
def test_gradient_checkpointing(when, monkeypatch):
    if when == "triton":  # the Triton training kernels (interpreter): in-place activation backward on recompute
        monkeypatch.setenv("FXREWRITE_TRITON", "1")
    stock = tiny_model("qwen3").train()
    enable_checkpointing(stock)
    fused = copy.deepcopy(tiny_model("qwen3")).train()
    if when == "before":
        enable_checkpointing(fused)
    fused = fxrewrite.optimize(fused)
    if when in ("after", "triton"):
        enable_checkpointing(fused)
    assert fused.model.gradient_checkpointing
    calls = []  # attention runs twice per step when its layer is checkpointed (the recompute)
    hooks = [layer.self_attn.register_forward_hook(lambda *a: calls.append(1)) for layer in fused.model.layers]
    assert_same_training_step(stock, fused, *_batch())
    for h in hooks:
        h.remove()
    assert len(calls) == 2 * len(fused.model.layers), "activation checkpointing is off in the optimized model"


def test_bf16_autocast_close_to_stock():
    stock = tiny_model("llama").train()
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    ids, labels = _batch()
    losses = []
    for model in (stock, fused):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=labels).loss
        loss.backward()
        losses.append(float(loss))
    assert abs(losses[0] - losses[1]) < 2e-2 * abs(losses[0])


@pytest.mark.parametrize("name", ["cohere", "granite"])
def test_logit_scaling_models(name):
    import transformers as T

    config = {"cohere": lambda: T.CohereConfig(logit_scale=0.3), "granite": lambda: T.GraniteConfig(logits_scaling=4.0)}
    cfg = config[name]()
    for k, v in dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0).items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    stock = T.AutoModelForCausalLM.from_config(cfg).train()
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    assert fused.lm_head_loss.kernel_params[1] is None  # a pure scale: the Triton kernel's form
    assert_same_training_step(stock, fused, *_batch())


def test_a_logit_scale_edited_after_optimize_is_followed(monkeypatch):
    """The proven scale / soft-cap holds while the config values the transform read are unchanged; edited after
    optimize, the loss (eager, and compiled without the deferred head gradient: the custom op) and the RL logprobs
    follow the model's own transform, as stock does (a fresh user found the optimize-time values kept)."""
    import transformers as T

    from fxrewrite.rl import completion_logprobs

    monkeypatch.setenv("FXREWRITE_DEFER_HEAD_GRAD", "0")
    cfg = T.GraniteConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
    torch.manual_seed(0)
    stock = T.AutoModelForCausalLM.from_config(cfg).train()
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    assert fused.lm_head_loss.depends == ((("config", "logits_scaling"), 1.0),)
    for model in (stock, fused):
        model.config.logits_scaling = 8.0
    ids, labels = _batch()
    want = float(stock(ids, labels=labels).loss)
    assert abs(float(fused(ids, labels=labels).loss) - want) <= 1e-6 * want
    compiled = torch.compile(fused, backend="aot_eager")
    assert abs(float(compiled(ids, labels=labels).loss) - want) <= 1e-5 * want
    with torch.no_grad():
        torch.testing.assert_close(completion_logprobs(fused, [[5, 6, 7]], [[11, 12, 13]])[0],
                                   completion_logprobs(stock, [[5, 6, 7]], [[11, 12, 13]])[0], rtol=1e-5, atol=1e-5)


def test_torch_compile_training_step_matches_eager():
    stock = tiny_model("qwen3").train()
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    compiled = torch.compile(fused, backend="aot_eager")
    ids, labels = _batch()
    want, want_grads = _step(stock, ids, labels)
    got = compiled(ids, labels=labels)
    got.loss.backward()
    assert got.logits is None
    assert abs(float(got.loss.detach()) - float(want.loss.detach())) <= 1e-6 * float(want.loss.detach())
    hf = to_hf_names(fused, {n: p.grad for n, p in fused.named_parameters()})
    for name, g in want_grads.items():
        assert _rel(hf[name], g) < 1e-5, name


def _moe_model():
    import transformers as T

    cfg = T.Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


@pytest.mark.parametrize("model,frozen", [
    ("qwen2", lambda n: not n.endswith("bias")),  # BitFit: weights frozen, q/k/v biases trained
    ("qwen2", lambda n: "q_proj" in n or "up_proj" in n),  # part of a fusion group frozen: that group stays unfused
    ("moe", lambda n: "experts.down_proj" in n),  # MoE: only the experts' gate/up trained
])
def test_partly_frozen_models_train_like_stock(model, frozen):
    """requires_grad set before optimize is kept per parameter: a fused parameter never freezes or trains one it
    replaced against the user's choice (the gradients of every trainable parameter equal stock's)."""
    stock = (_moe_model() if model == "moe" else tiny_model(model)).train()
    for name, p in stock.named_parameters():
        p.requires_grad_(not frozen(name))
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    assert_same_training_step(stock, fused, *_batch())
    assert {n for n, p in fused.state_dict(keep_vars=True).items() if p.requires_grad} == \
        {n for n, p in stock.named_parameters() if p.requires_grad}
    refused = [r for _, p, r in fxrewrite.explain(fused).skipped() if p == "qkv"]
    assert bool(refused) == (frozen("q_proj.weight") != frozen("k_proj.weight")), refused


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_positions_past_max_position_embeddings_match_stock(arch):
    """A sequence longer than max_position_embeddings, and packed position ids far past it: stock computes
    cos/sin for any position, so the optimized model must too (it raised IndexError on the rotary cache)."""
    stock = tiny_model(arch, max_position_embeddings=16).train()
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    ids = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(1))
    assert_same_training_step(stock, fused, ids, ids.clone())
    packed = torch.cat([torch.arange(12), torch.arange(500, 512)])[None]
    assert_same_training_step(stock, fused, ids, ids.clone(), position_ids=packed)
    with torch.no_grad():
        torch.testing.assert_close(fused.eval()(ids).logits, stock.eval()(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("defer", ["1", "0"])
@pytest.mark.parametrize("num_items", [None, 0, "tensor"])
def test_a_batch_with_every_label_ignored_has_zero_gradients_as_stock(defer, num_items, monkeypatch):
    """Every label -100 (a prompt-only batch after truncation): stock's loss is NaN (0 / 0) and every gradient 0, so
    an optimizer step does not hurt; the fused loss gave NaN in every gradient (0 * (1 / 0)), and that step made
    every weight NaN."""
    monkeypatch.setenv("FXREWRITE_DEFER_HEAD_GRAD", defer)
    stock = tiny_model("llama").train()
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    ids, labels = _batch()
    kwargs = {} if num_items is None else {"num_items_in_batch": torch.tensor(0) if num_items == "tensor" else 0}
    for model in (stock, fused):
        out, grads = _step(model, ids, torch.full_like(labels, -100), **kwargs)
        assert torch.isnan(out.loss)
        assert grads and all(torch.equal(g, torch.zeros_like(g)) for g in grads.values()), type(model).__name__
