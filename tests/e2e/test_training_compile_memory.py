"""``torch.compile(fxrewrite.optimize(model))`` in training keeps the memory savings: the graphs Inductor would
receive (AOT autograd's forward and backward after its min-cut partition, the one Inductor uses) hold no value of
[tokens, vocab] anywhere; ``outputs.logits`` is None as in eager. With the LM head's gradient deferred (the default)
the loss runs eagerly between the deferral's two graph breaks; with FXREWRITE_DEFER_HEAD_GRAD=0 it is one opaque
``fxrewrite::fused_linear_cross_entropy`` node, with no graph break."""

from __future__ import annotations

import pytest
import torch
from tests.e2e.compile_breaks import assert_deferral_breaks, graph_breaks
from tests.e2e.tiny_models import tiny_model
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import min_cut_rematerialization_partition

import fxrewrite

VOCAB, BATCH, SEQ = 97, 2, 13  # a vocab no other dim of the tiny models has (2 * intermediate is 96)


def _capture(graphs: list):
    def compiler(gm, example_inputs):
        graphs.append(gm)
        return gm

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=compiler, bw_compiler=compiler,
                                     partition_fn=min_cut_rematerialization_partition)
    return backend


def _logits_like(v) -> bool:
    """[tokens, vocab] or [batch, seq, vocab] (leading dims are tokens, not the head weight's hidden size)."""
    return v.dim() >= 2 and v.shape[-1] == VOCAB and v.shape[0] in (BATCH, BATCH * SEQ, BATCH * (SEQ - 1))


def _values(gm):
    for node in gm.graph.nodes:
        vals = node.meta.get("val")
        for v in vals if isinstance(vals, (tuple, list)) else (vals,):
            if isinstance(v, torch.Tensor):
                yield node, v


@pytest.mark.parametrize("defer", [True, False])
@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_compiled_graphs_never_hold_logits(arch, defer, monkeypatch):
    from torch._dynamo.utils import counters

    if not defer:
        monkeypatch.setenv("FXREWRITE_DEFER_HEAD_GRAD", "0")
    model = fxrewrite.optimize(tiny_model(arch, num_hidden_layers=1, vocab_size=VOCAB).train()).train()
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))
    graphs: list = []
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(model, backend=_capture(graphs))(ids, labels=ids)
    out.loss.backward()
    if defer:
        assert_deferral_breaks()
    else:
        assert graph_breaks() == {}
    assert out.logits is None
    assert len(graphs) >= 2  # a forward and a backward
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("fused_linear_cross_entropy" in t for t in targets) is not defer, sorted(targets)
    big = [(n.name, tuple(v.shape)) for g in graphs for n, v in _values(g) if _logits_like(v)]
    assert not big, big


def test_the_check_sees_logits_of_a_stock_model():
    """The same capture on the stock model finds the [tokens, vocab] logits (the check can fail)."""
    model = tiny_model("qwen3", num_hidden_layers=1, vocab_size=VOCAB).train()
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))
    graphs: list = []
    torch._dynamo.reset()
    torch.compile(model, backend=_capture(graphs))(ids, labels=ids).loss.backward()
    assert any(_logits_like(v) for g in graphs for _, v in _values(g))
