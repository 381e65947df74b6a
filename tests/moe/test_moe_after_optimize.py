"""Hooks and router attributes set on a fused MoE block's modules after `optimize` (fresh users' finds: a hook on
the experts scaled the residual too, a hook on the router and a changed top_k / norm_topk_prob were ignored, a hook
on the block itself saw the folded call, all silently): each is honoured as stock honours it, in the decode fold
(no autograd) and in training."""

from __future__ import annotations

import copy

import pytest
import torch

import fxrewrite
from tests.moe.conftest import stock_eager, tiny_moe


def _scale_experts(m):
    m.model.layers[0].mlp.experts.register_forward_hook(lambda mod, args, out: out * 2)


def _halve_router_weights(m):
    def hook(mod, args, out):
        out = list(out)
        out[1] = out[1] * 0.5  # (logits, top-k weights, top-k ids): transformers 5's routers
        return tuple(out)
    m.model.layers[1].mlp.gate.register_forward_hook(hook)


def _scale_block_input(m):
    m.model.layers[0].mlp.register_forward_pre_hook(lambda mod, args: (args[0] * 2,) + tuple(args[1:]))


def _scale_block_output(m):
    m.model.layers[1].mlp.register_forward_hook(lambda mod, args, out: out * 2 + args[0] * 0.1)


def _scale_block_input_with_kwargs(m):
    m.model.layers[0].mlp.register_forward_pre_hook(lambda mod, args, kwargs: ((args[0] * 2,), kwargs),
                                                    with_kwargs=True)


def _scale_block_output_with_kwargs(m):
    def hook(mod, args, kwargs, out):
        assert not kwargs  # transformers' call: block(x)
        return out * 2 + args[0] * 0.1
    m.model.layers[1].mlp.register_forward_hook(hook, with_kwargs=True)


def _scale_block_forward(m):
    block = m.model.layers[1].mlp
    block.forward = lambda x: type(block).forward(block, x) * 3  # a forward on the instance is a hook too


def _top_1(m):
    m.model.layers[0].mlp.gate.top_k = 1


def _renormalize(m):
    m.model.layers[1].mlp.gate.norm_topk_prob = not m.model.layers[1].mlp.gate.norm_topk_prob


CASES = [(family, change) for family in ("qwen3_moe", "mixtral", "olmoe")
         for change in (_scale_experts, _halve_router_weights, _top_1, _renormalize, _scale_block_input,
                        _scale_block_output, _scale_block_input_with_kwargs, _scale_block_output_with_kwargs,
                        _scale_block_forward)
         if not (family == "mixtral" and change is _renormalize)]  # Mixtral's router has no norm_topk_prob


@pytest.mark.parametrize(("family", "change"), CASES)
def test_a_change_after_optimize_is_honoured(family, change):
    stock = stock_eager(tiny_moe(family))
    unchanged = copy.deepcopy(stock)
    model = fxrewrite.optimize(copy.deepcopy(stock))
    change(stock), change(model)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = stock(ids).logits
        assert (want - unchanged(ids).logits).abs().max() > 1e-3  # the change moves stock's numbers
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
    model.train()(ids, labels=ids).loss.backward()
    stock.train()(ids, labels=ids).loss.backward()
    gate = "model.layers.1.mlp.gate.weight"
    torch.testing.assert_close(model.get_parameter(gate).grad, stock.get_parameter(gate).grad, rtol=1e-4, atol=1e-6)


def _halve_grad_input(m, seen):
    def hook(mod, grad_input, grad_output):
        seen.append((len(grad_input), len(grad_output)))
        return tuple(g * 0.5 for g in grad_input)
    m.model.layers[1].mlp.register_full_backward_hook(hook)


def _triple_grad_output(m, seen):
    def hook(mod, grad_output):
        seen.append((len(grad_output),))
        return tuple(g * 3 for g in grad_output)
    m.model.layers[1].mlp.register_full_backward_pre_hook(hook)


@pytest.mark.parametrize("change", [_halve_grad_input, _triple_grad_output])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_a_backward_hook_on_the_block_after_optimize_sees_and_changes_stock_gradients(family, change):
    """A backward (pre-)hook on a fused block gets the gradients of transformers' call, block(norm(r)), and what it
    returns reaches the layers below as in stock (it had seen the folded call's (out + r, r), and a change to its
    inputs' gradients leaked into the residual stream)."""
    stock = stock_eager(tiny_moe(family))
    model, plain = fxrewrite.optimize(copy.deepcopy(stock)), copy.deepcopy(stock)
    seen_stock, seen_model = [], []
    change(stock, seen_stock), change(model, seen_model)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    for m in (stock, model, plain):
        m.train()(ids, labels=ids).loss.backward()
    assert seen_model == seen_stock and seen_stock
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"):
        want = stock.get_parameter(name).grad
        if "layers.1" not in name:  # below the hooked block: the hook moves stock's gradient
            assert (want - plain.get_parameter(name).grad).abs().max() > 1e-6
        torch.testing.assert_close(model.get_parameter(name).grad, want, rtol=1e-4, atol=1e-6)


def test_the_experts_activation_changed_after_optimize_is_refused():
    """transformers' experts module keeps its act_fn; the fused experts keep it at the same path (the stock module
    tree) and refuse a forward once it is replaced or hooked, or given a forward of its own instance (a new act_fn had
    been silently ignored); before
    optimize, the same change leaves the block unfused and stock's numbers come out."""
    from transformers.activations import ACT2FN

    model = fxrewrite.optimize(tiny_moe("qwen3_moe"))
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts.act_fn, type(ACT2FN["silu"])) and "model.layers.0.mlp.experts.act_fn" in dict(
        model.named_modules())
    ids = torch.tensor([[5, 6, 7]])
    handle = experts.act_fn.register_forward_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match=r"experts.act_fn was hooked after fxrewrite.optimize"):
        model(ids)
    handle.remove()
    model(ids)
    experts.act_fn.forward = lambda x: x  # a forward put on its instance is a hook too (it was silently ignored)
    with pytest.raises(RuntimeError, match=r"experts.act_fn was hooked after fxrewrite.optimize"):
        model(ids)
    del experts.act_fn.forward
    model(ids)
    experts.act_fn = ACT2FN["gelu"]
    with pytest.raises(RuntimeError, match=r"experts.act_fn was replaced after fxrewrite.optimize"):
        model(ids)
    stock = stock_eager(tiny_moe("qwen3_moe"))
    stock.model.layers[0].mlp.experts.act_fn = ACT2FN["gelu"]
    changed = fxrewrite.optimize(copy.deepcopy(stock))
    with torch.no_grad():
        torch.testing.assert_close(changed(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)
