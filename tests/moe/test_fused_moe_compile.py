"""torch.compile of an optimized MoE model: the fused experts enter the graph as the custom ops
``fxrewrite::fused_experts`` (inference) and ``fxrewrite::fused_experts_train`` + its backward op (training), with
no graph break, and the results equal eager (Triton in the interpreter, float32)."""

from __future__ import annotations

import copy

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

import fxrewrite
from fxrewrite.kernels.fused_moe import fused_experts_ref
from fxrewrite.weights import to_hf_names
from tests.moe.conftest import expert_inputs, stock_eager, tiny_moe

CHECKS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")




@pytest.mark.parametrize("expert_start", [0, 2])
def test_train_op_matches_reference_and_passes_opcheck(triton_on, expert_start):
    x, w13, w2, weights, ids = expert_inputs()
    ids = ids + expert_start // 2  # some slots routed to experts this rank does not hold
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, weights)]
    want = fused_experts_ref(*leaves, ids, expert_start)
    dy = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, leaves, dy)
    leaves = [t.clone().requires_grad_() for t in leaves]
    got = torch.ops.fxrewrite.fused_experts_train(*leaves, ids, expert_start)[0]
    got_grads = torch.autograd.grad(got, leaves, dy)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, r in zip(got_grads, want_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    torch.library.opcheck(torch.ops.fxrewrite.fused_experts_train.default, (*leaves, ids, expert_start),
                          test_utils=CHECKS)
    torch.library.opcheck(torch.ops.fxrewrite.fused_experts.default, (x, w13, w2, weights, ids, expert_start),
                          test_utils=("test_schema", "test_faketensor"))


def _graph_breaks() -> dict[str, int]:
    return {reason: n for reason, n in counters["graph_break"].items() if n}


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_compiled_training_step_has_no_graph_break(triton_on, monkeypatch, family):
    """The whole training step is one graph (the loss as its custom op), the experts' op in the forward graph and
    its backward op in the backward graph; loss and gradients equal stock transformers' eager step."""
    monkeypatch.setenv("FXREWRITE_DEFER_HEAD_GRAD", "0")
    stock = stock_eager(tiny_moe(family, num_hidden_layers=1, use_cache=False)).train()
    model = fxrewrite.optimize(copy.deepcopy(stock)).train()
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    want = stock(ids, labels=ids).loss
    want.backward()
    seen: dict[str, set[str]] = {"fw": set(), "bw": set()}

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            seen[kind].update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return make_boxed_func(gm)
        return compile_graph

    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(model, backend=aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw")))(
        ids, labels=ids).loss
    got.backward()
    assert _graph_breaks() == {}
    assert "fxrewrite.fused_experts_train.default" in seen["fw"]
    assert "fxrewrite.fused_experts_train_backward.default" in seen["bw"]
    assert abs(float(got.detach()) - float(want.detach())) <= 1e-6 * abs(float(want.detach()))
    grads = to_hf_names(model, {n: p.grad for n, p in model.named_parameters()})
    for name, p in stock.named_parameters():
        err = float((grads[name] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12))
        assert err < 1e-5, (name, err)


def test_regionally_compiled_layers_serve_without_graph_break(triton_on):
    """The engine's regional compile (each decoder layer's forward compiled, dynamic token count): the layer is one
    graph with the inference op in it, at prefill and at decode sizes, and the logits equal eager's."""
    model = fxrewrite.optimize(tiny_moe("olmoe", num_hidden_layers=2))
    seen: set[str] = set()

    def backend(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(3, 96, (1, n), generator=gen) for n in (40, 3)]
    with torch.no_grad():
        want = [model(ids).logits for ids in batches]
        torch._dynamo.reset()
        counters.clear()
        for layer in model.model.layers:
            layer.forward = torch.compile(layer.forward, backend=backend, dynamic=True)
        got = [model(ids).logits for ids in batches]
    assert _graph_breaks() == {}
    assert {"fxrewrite.fused_experts", "fxrewrite.fused_experts.default"} & seen, seen  # dynamo's graph: the packet
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_router_logits_under_compile_match_stock(triton_on):
    """output_router_logits (the auxiliary loss) through a compiled optimized model: transformers' recorder hook on
    the router still sees the logits, and the loss with its aux term equals stock's."""
    stock = stock_eager(tiny_moe("qwen3_moe", num_hidden_layers=1, output_router_logits=True)).train()
    model = fxrewrite.optimize(copy.deepcopy(stock)).train()
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(6))
    want = stock(ids, labels=ids)
    torch._dynamo.reset()
    got = torch.compile(model, backend="aot_eager")(ids, labels=ids)
    assert got.aux_loss is not None
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t,expert_start", [(7, 0), (16, 0), (9, 2), (0, 0)])
def test_grouped_mm_training_path_matches_reference(t, expert_start):
    """torch's grouped GEMM path (the bf16 GPU training default), here in float32 on the CPU: output and gradients
    equal the reference, with padded slot rows (T*K not a multiple of 16), with slots of experts held elsewhere, and
    with no tokens."""
    from fxrewrite.kernels.fused_moe_grouped_mm import grouped_mm_experts

    x, w13, w2, weights, ids = expert_inputs(t=t, h=16, i=24, seed=t)
    ids = ids + expert_start // 2
    leaves = [v.clone().requires_grad_() for v in (x, w13, w2, weights)]
    want = fused_experts_ref(*leaves, ids, expert_start)
    dy = torch.randn_like(want)
    # no tokens: the reference's output has no graph (zeros); every gradient is zero
    want_grads = torch.autograd.grad(want, leaves, dy) if want.requires_grad else [torch.zeros_like(v) for v in leaves]
    leaves = [v.clone().requires_grad_() for v in leaves]
    got = grouped_mm_experts(*leaves, ids, expert_start)
    got_grads = torch.autograd.grad(got, leaves, dy)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, r in zip(got_grads, want_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
