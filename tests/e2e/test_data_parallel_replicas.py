"""``nn.DataParallel`` after ``optimize`` (transformers' Trainer wraps a model in it on a machine with several GPUs
and no launcher): every replica must run its own copies of the weights through the rewritten forwards.

``torch.nn.parallel.replicate`` is run as is, with the broadcast to devices replaced by copies on the CPU that differ
per replica (replica j's parameters scaled by 1 + j/10, through autograd as the broadcast is), so a forward still bound
to the original module (the first device's weights) shows in the numbers.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from tests.e2e.tiny_models import tiny_model

import fxrewrite
from fxrewrite.weights import to_hf_names

replicate_module = importlib.import_module("torch.nn.parallel.replicate")


def _scaled_copies(tensors, devices, detach):
    """Replica j's copies: parameters scaled by 1 + j/10 (through autograd unless `detach`), buffers as they are."""
    def copy(t, j):
        scale = 1 + j / 10 if isinstance(t, torch.nn.Parameter) else 1
        return (t.detach() if detach else t) * scale if t.is_floating_point() else t.clone()

    return [[copy(t, j) for t in tensors] for j in range(len(devices))]


def _replicas(model, monkeypatch):
    monkeypatch.setattr(replicate_module, "_broadcast_coalesced_reshape", _scaled_copies)
    return torch.nn.parallel.replicate(model, [0, 1])


def _run(model, monkeypatch, ids, train: bool):
    """Each replica's logits (eval) or loss (train, backward of their sum run) on its half of the batch."""
    model.train(train)
    model.zero_grad()
    outs = [replica(input_ids=ids[j::2], labels=ids[j::2] if train else None)
            for j, replica in enumerate(_replicas(model, monkeypatch))]
    if not train:
        return [o.logits.detach() for o in outs]
    sum(o.loss for o in outs).backward()
    fused_loss = [o.logits is None for o in outs]  # the fused loss leaves the logits out
    assert fused_loss == [hasattr(model, "lm_head_loss")] * 2
    return [o.loss.detach() for o in outs]


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_data_parallel_replicas_run_their_own_weights(arch, monkeypatch):
    stock = tiny_model(arch)
    fused = fxrewrite.optimize(copy.deepcopy(stock))
    ids = torch.randint(3, 96, (4, 12), generator=torch.Generator().manual_seed(1))
    for train in (False, True):
        want, got = _run(stock, monkeypatch, ids, train), _run(fused, monkeypatch, ids, train)
        assert not torch.allclose(want[0], want[1])  # the replicas' weights differ
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    want_grads = {name: p.grad for name, p in stock.named_parameters()}
    got_grads = to_hf_names(fused, {name: p.grad for name, p in fused.named_parameters()})
    assert set(got_grads) == set(want_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_replica_forward_is_bound_to_the_replica(monkeypatch):
    fused = fxrewrite.optimize(tiny_model("llama"))
    replica = _replicas(fused, monkeypatch)[1]
    own = [(name, m) for name, m in replica.named_modules() if "forward" in m.__dict__]
    assert own, "optimize rewrote no forward"
    for name, module in own:
        assert module.forward.__self__ is module, name
