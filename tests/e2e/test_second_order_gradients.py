"""Second-order gradients (backward with create_graph=True: a gradient penalty) through `optimize`: equal to stock
transformers' (float32, CPU) where the fused loss can differentiate twice (inputs_embeds, or the LM-head gradient not
deferred), tied or untied; a clear error where the deferred head gradient would drop terms. They were silently wrong:
the fused loss's backward only scaled gradients made in its forward, which carry no graph (a fresh user's finding)."""

from __future__ import annotations

import pytest
import torch
from tests.e2e.tiny_models import tiny_model

import fxrewrite
from fxrewrite.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy, fused_linear_cross_entropy_ref
from fxrewrite.weights import to_hf_names

IDS = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))


def _model(arch: str, tied: bool):
    model = tiny_model(arch, tie_word_embeddings=tied)
    model.set_attn_implementation("eager")  # torch's CPU SDPA has no second derivative
    return model


def _penalty_grads(model, embeds: bool) -> dict[str, torch.Tensor]:
    """Parameter gradients of the squared norm of d loss / d (input embeddings, or every parameter)."""
    model.train()
    model.zero_grad(set_to_none=True)
    if embeds:
        e = model.get_input_embeddings()(IDS).detach().requires_grad_()
        grads = torch.autograd.grad(model(inputs_embeds=e, labels=IDS).loss, e, create_graph=True)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(model(input_ids=IDS, labels=IDS).loss, params, create_graph=True)
    sum(g.pow(2).sum() for g in grads).backward()
    return to_hf_names(model, {n: p.grad for n, p in model.named_parameters() if p.grad is not None})


@pytest.mark.parametrize("arch, tied", [("llama", True), ("gemma2", False)])
@pytest.mark.parametrize("embeds", [True, False])
def test_gradient_penalty_equals_stock(arch, tied, embeds, monkeypatch):
    if not embeds:
        monkeypatch.setenv("FXREWRITE_DEFER_HEAD_GRAD", "0")
    stock = _penalty_grads(_model(arch, tied), embeds)
    ours = _penalty_grads(fxrewrite.optimize(_model(arch, tied)), embeds)
    assert ours.keys() == stock.keys()
    for name, want in stock.items():  # float32: the fused GEMMs sum in another order (1e-5 of the largest entry)
        assert float((ours[name] - want).abs().max()) <= 1e-5 * float(want.abs().max()), name


def test_the_deferred_head_gradient_refuses_create_graph():
    model = fxrewrite.optimize(_model("llama", True)).train()
    params = [p for p in model.parameters() if p.requires_grad]
    loss = model(input_ids=IDS, labels=IDS).loss
    with pytest.raises(RuntimeError, match="create_graph=True.*FXREWRITE_DEFER_HEAD_GRAD=0"):
        torch.autograd.grad(loss, params, create_graph=True)


def test_fused_loss_second_order_equals_reference_with_a_tied_input():
    """hidden made from the weight itself (a tied embedding): the partial derivatives, not the total ones."""
    torch.manual_seed(0)
    w = torch.randn(50, 16, requires_grad=True)
    target = torch.randint(0, 50, (24,))
    rows = torch.randint(0, 50, (24,))

    def second(loss_fn):
        loss = loss_fn(w[rows] * 1.5, w, None, target)
        (g,) = torch.autograd.grad(loss, w, create_graph=True)
        return torch.autograd.grad(g.pow(2).sum(), w)[0]

    torch.testing.assert_close(second(lambda *a: fused_linear_cross_entropy(*a, chunk_size=7)),
                               second(fused_linear_cross_entropy_ref), rtol=1e-4, atol=1e-6)
