"""The LM head's weight gradient made after the layers' backward (fxrewrite.layers.deferred_head_grad), eager and under
torch.compile: nothing of [vocab, hidden] is saved by the forward, d/dweight is made once every decoder layer's
gradient is in, and every gradient equals stock transformers' (float32, CPU), tied or not, with inputs_embeds (not
deferred), with two forwards before their backwards, and under gradient accumulation (num_items_in_batch, a loss
scaled before its backward)."""

from __future__ import annotations

import inspect

import pytest
import torch
from tests.e2e.compile_breaks import assert_deferral_breaks, graph_breaks
from tests.e2e.tiny_models import tiny_model

import fxrewrite
from fxrewrite.benchmarks.train import enable_checkpointing
from fxrewrite.kernels import fused_linear_cross_entropy as flce
from fxrewrite.kernels import fused_linear_cross_entropy_op as flce_op
from fxrewrite.layers import deferred_head_grad
from fxrewrite.weights import to_hf_names


def _grads(model, *calls, runner=None, scale=1.0):
    """Gradients after one forward per call (through ``runner``, default ``model``), then each loss * scale's
    backward."""
    model.zero_grad(set_to_none=True)
    losses = [(model if runner is None else runner)(**kw).loss for kw in calls]
    for loss in losses:
        (loss * scale).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compiled(model):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return torch.compile(model, backend="aot_eager")


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
    assert job is not None and job.args is not None and job.args[0] is None  # claimed; the loss keeps the hidden
    assert vocab_by_hidden not in shapes, shapes
    loss.backward()
    assert job.args[0] is None  # the hidden states were released by the deferred backward
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


@pytest.mark.parametrize("defer", ["1", "0"])
@pytest.mark.parametrize("tied", [True, False])
def test_retained_graph_backward_twice_and_a_second_loss(monkeypatch, defer, tied):
    """loss.backward(retain_graph=True) then loss.backward() accumulates the gradient twice, as stock does (the loss's
    stored gradients are scaled in place by the first backward only, the deferred head gradient is re-armed by the
    second); a second loss on the same forward's hidden states adds only its own gradients."""
    monkeypatch.setenv("FXREWRITE_DEFER_HEAD_GRAD", defer)
    stock, fused = _pair(tied)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    results = []
    for model in (fused, stock):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, output_hidden_states=True)
        out.loss.backward(retain_graph=True)
        (out.loss * 0.5).backward(retain_graph=True)
        out.hidden_states[-1].pow(2).mean().backward()
        results.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    _assert_same(fused, *results)


def test_tuple_output_keeps_the_logits():
    """return_dict=False: the stock path, so the tuple is (loss, logits, ...) as stock's, not (loss, ...) with every
    later element moved up; a ModelOutput call afterwards fuses again. (A config with return_dict False breaks
    stock Qwen3 itself in transformers 5: its outer forward reads the inner one's ModelOutput fields.)"""
    stock, fused = _pair(False)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    outs = [model(input_ids=ids, labels=ids, output_hidden_states=True, return_dict=False) for model in (fused, stock)]
    assert [type(x) for x in outs[0]] == [type(x) for x in outs[1]] and len(outs[0]) == len(outs[1]) == 3
    assert torch.allclose(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-6)
    assert fused(input_ids=ids, labels=ids).logits is None  # fused: no logits made


def test_switch_off(monkeypatch):
    monkeypatch.setenv("FXREWRITE_DEFER_HEAD_GRAD", "0")
    stock = tiny_model("qwen3", tie_word_embeddings=True, use_cache=False).train()
    fused = fxrewrite.optimize(tiny_model("qwen3", tie_word_embeddings=True, use_cache=False).train()).train()
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    got = _grads(fused, dict(input_ids=ids, labels=ids))
    assert all(m.deferred is None for m in fused.modules() if type(m).__name__ == "LMHeadCrossEntropy")
    _assert_same(fused, got, _grads(stock, dict(input_ids=ids, labels=ids)))


def _pair(tied: bool, checkpointing: bool = False):
    models = [tiny_model("qwen3", tie_word_embeddings=tied, use_cache=False).train() for _ in range(2)]
    stock, fused = models[0], fxrewrite.optimize(models[1]).train()
    if checkpointing:
        enable_checkpointing(stock)
        enable_checkpointing(fused)
    return stock, fused


def _spy_head_grad(monkeypatch, model) -> tuple[list, dict]:
    """Records, for each d/dweight [vocab, hidden] the fused loss makes (eager autograd function, custom op, deferred
    backward): (during the backward, every decoder layer's gradient in, the head's gradient None, the embedding's
    gradient None). ``phase["backward"]`` is the test's to set."""
    record, phase = [], {"backward": False}
    layers = list(model.model.layers.parameters())

    def spy(real):
        def wrapped(*args):
            if args[9]:  # want_w
                record.append((phase["backward"], all(p.grad is not None for p in layers),
                               model.lm_head.weight.grad is None, model.get_input_embeddings().weight.grad is None))
            return real(*args)
        return wrapped

    for module in (flce, flce_op, deferred_head_grad):
        monkeypatch.setattr(module, "forward_with_grads", spy(module.forward_with_grads))
    return record, phase


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("mode", ["eager", "compile", "compile-checkpointed"])
def test_head_gradient_made_after_every_layer_gradient(mode, tied, monkeypatch):
    """The ordering that saves the memory: d/dweight is made in the backward once every decoder layer's gradient is
    accumulated and before the head's / embedding's; under torch.compile with exactly the deferral's graph breaks,
    and on the second step with no recompile (the per-call job is no guard)."""
    stock, fused = _pair(tied, checkpointing=mode.endswith("checkpointed"))
    runner = _compiled(fused) if mode != "eager" else fused
    record, phase = _spy_head_grad(monkeypatch, fused)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    want = _grads(stock, dict(input_ids=ids, labels=ids))
    for step in range(2):
        fused.zero_grad(set_to_none=True)
        phase["backward"] = False
        loss = runner(input_ids=ids, labels=ids).loss
        phase["backward"] = True
        loss.backward()
        assert record == [(True, True, True, True)] * (step + 1), record
        _assert_same(fused, {n: p.grad.clone() for n, p in fused.named_parameters()}, want)
        if mode != "eager":
            assert_deferral_breaks()  # counted at the first compile only: the second step compiled nothing


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_the_ordering_check_fails_when_not_deferred(mode, monkeypatch):
    """FXREWRITE_DEFER_HEAD_GRAD=0: d/dweight made in the loss's forward (the custom op under compile, no graph
    break), before any layer gradient: the spy above tells the two apart."""
    monkeypatch.setenv("FXREWRITE_DEFER_HEAD_GRAD", "0")
    stock, fused = _pair(tied=False)
    runner = _compiled(fused) if mode == "compile" else fused
    record, phase = _spy_head_grad(monkeypatch, fused)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    loss = runner(input_ids=ids, labels=ids).loss
    phase["backward"] = True
    loss.backward()
    assert record == [(False, False, True, True)], record
    if mode == "compile":
        assert graph_breaks() == {}
    _assert_same(fused, {n: p.grad.clone() for n, p in fused.named_parameters()},
                 _grads(stock, dict(input_ids=ids, labels=ids)))


@pytest.mark.parametrize("mode,tied", [("eager", True), ("eager", False), ("compile", True)])
def test_gradient_accumulation(mode, tied):
    """Two micro-batches of different lengths accumulated: each loss over num_items_in_batch (a tensor, as Trainer
    passes it), then each loss scaled by 1/2 before its backward (Trainer without num_items); equal to stock."""
    stock, fused = _pair(tied)
    runner = _compiled(fused) if mode == "compile" else None
    gen = torch.Generator().manual_seed(6)
    a, b = torch.randint(3, 96, (2, 9), generator=gen), torch.randint(3, 96, (2, 7), generator=gen)
    la = a.clone()
    la[0, :4] = -100
    items = torch.tensor(int((la[:, 1:] != -100).sum() + (b[:, 1:] != -100).sum()))
    calls = [dict(input_ids=a, labels=la, num_items_in_batch=items),
             dict(input_ids=b, labels=b, num_items_in_batch=items)]
    _assert_same(fused, _grads(fused, *calls, runner=runner), _grads(stock, *calls))
    calls = [dict(input_ids=a, labels=la), dict(input_ids=b, labels=b)]
    _assert_same(fused, _grads(fused, *calls, runner=runner, scale=0.5), _grads(stock, *calls, scale=0.5))
    if mode == "compile":
        assert set(graph_breaks()) == {"attach", "loss"}  # also when the second length recompiles (dynamic shapes)


def test_inputs_embeds_and_two_forwards_under_compile():
    """Compiled: two forwards before their backwards each defer to their own job; an inputs_embeds call (the
    embedding does not run, no job) takes the eager loss with the gradient made in its forward; equal to stock."""
    stock, fused = _pair(tied=True)
    runner = _compiled(fused)
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randint(3, 96, (2, 9), generator=gen), torch.randint(3, 96, (2, 9), generator=gen)
    calls = [dict(input_ids=a, labels=a), dict(input_ids=b, labels=b)]
    _assert_same(fused, _grads(fused, *calls, runner=runner), _grads(stock, *calls))
    with torch.no_grad():
        emb_f, emb_s = fused.get_input_embeddings()(a), stock.get_input_embeddings()(a)
    got = _grads(fused, dict(inputs_embeds=emb_f.clone().requires_grad_(), labels=a), runner=runner)
    assert fused.lm_head_loss.deferred is None
    _assert_same(fused, got, _grads(stock, dict(inputs_embeds=emb_s.clone().requires_grad_(), labels=a)))
    assert set(graph_breaks()) == {"attach", "loss"}


def test_fullgraph_needs_the_switch_off(monkeypatch):
    """torch.compile(fullgraph=True) raises at the deferral's first break, naming the switch; with the switch off it
    compiles the loss as the custom op, in one graph."""
    _, fused = _pair(tied=True)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(8))
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="FXREWRITE_DEFER_HEAD_GRAD=0"):
        torch.compile(fused, backend="aot_eager", fullgraph=True)(input_ids=ids, labels=ids)
    monkeypatch.setenv("FXREWRITE_DEFER_HEAD_GRAD", "0")
    torch._dynamo.reset()
    torch.compile(fused, backend="aot_eager", fullgraph=True)(input_ids=ids, labels=ids).loss.backward()
    assert fused.lm_head.weight.grad is not None


def test_only_calls_with_labels_defer():
    """A training call without labels (an RL loss on the logits) makes no job, and under torch.compile no graph
    break; labels given by position arm the deferral as by keyword."""
    _, fused = _pair(tied=True)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(9))
    fused(ids).logits.sum().backward()
    assert fused.lm_head_loss.deferred is None and not fused.lm_head_loss.armed
    at = list(inspect.signature(fused.forward).parameters).index("labels")
    fused(*([ids] + [None] * (at - 1) + [ids]))
    assert fused.lm_head_loss.armed and fused.lm_head_loss.deferred.args is not None
    runner = _compiled(fused)
    out = runner(ids)
    out.logits.sum().backward()
    assert graph_breaks() == {}
    assert fused.lm_head_loss.deferred is None
