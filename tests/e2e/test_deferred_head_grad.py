"""The LM head's weight gradient made after the layers' backward (fxrewrite.layers.deferred_head_grad): nothing of
[vocab, hidden] is saved by the forward, and every gradient equals stock transformers' (float32, CPU), tied or not,
with inputs_embeds (not deferred) and with two forwards before their backwards."""

from __future__ import annotations

import pytest
import torch
from tests.e2e.tiny_models import tiny_model

import fxrewrite
from fxrewrite.weights import to_hf_names


def _grads(model, *calls):
    model.zero_grad(set_to_none=True)
    losses = [model(**kw).loss for kw in calls]
    for loss in losses:
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(fused, got, want):
    hf = to_hf_names(fused, got)
    assert set(hf) == set(want)
    for name, g in want.items():
        assert float((hf[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)) < 1e-5, name


@pytest.mark.parametrize("tied", [True, False])
def test_head_gradient_deferred_and_equal_to_stock(tied):
    stock = tiny_model("qwen3", tie_word_embeddings=tied, use_cache=False).train()
    fused = fxrewrite.optimize(tiny_model("qwen3", tie_word_embeddings=tied, use_cache=False).train()).train()
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    vocab_by_hidden = tuple(fused.lm_head.weight.shape)
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        loss = fused(input_ids=ids, labels=ids).loss
    job = fused.lm_head_loss.deferred if hasattr(fused, "lm_head_loss") else next(
        m.deferred for m in fused.modules() if type(m).__name__ == "LMHeadCrossEntropy")
    assert job is not None and job.attached and job.args is not None
    assert vocab_by_hidden not in shapes, shapes
    loss.backward()
    assert job.args is None  # the hidden states were released by the deferred backward
    got = {n: p.grad.clone() for n, p in fused.named_parameters() if p.grad is not None}
    _assert_same(fused, got, _grads(stock, dict(input_ids=ids, labels=ids)))


def test_inputs_embeds_and_two_forwards_before_backward():
    stock = tiny_model("qwen3", tie_word_embeddings=True, use_cache=False).train()
    fused = fxrewrite.optimize(tiny_model("qwen3", tie_word_embeddings=True, use_cache=False).train()).train()
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randint(3, 96, (2, 9), generator=gen), torch.randint(3, 96, (2, 7), generator=gen)
    calls = [dict(input_ids=a, labels=a), dict(input_ids=b, labels=b)]
    _assert_same(fused, _grads(fused, *calls), _grads(stock, *calls))
    with torch.no_grad():
        emb_f, emb_s = fused.get_input_embeddings()(a), stock.get_input_embeddings()(a)
    calls_f = [dict(inputs_embeds=emb_f.clone().requires_grad_(), labels=a)]
    calls_s = [dict(inputs_embeds=emb_s.clone().requires_grad_(), labels=a)]
    _assert_same(fused, _grads(fused, *calls_f), _grads(stock, *calls_s))


def test_switch_off(monkeypatch):
    monkeypatch.setenv("FXREWRITE_DEFER_HEAD_GRAD", "0")
    stock = tiny_model("qwen3", tie_word_embeddings=True, use_cache=False).train()
    fused = fxrewrite.optimize(tiny_model("qwen3", tie_word_embeddings=True, use_cache=False).train()).train()
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    got = _grads(fused, dict(input_ids=ids, labels=ids))
    assert all(m.deferred is None for m in fused.modules() if type(m).__name__ == "LMHeadCrossEntropy")
    _assert_same(fused, got, _grads(stock, dict(input_ids=ids, labels=ids)))
