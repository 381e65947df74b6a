"""The saved-tensor report: optimize keeps less for the backward than stock transformers (tiny Qwen3, CPU)."""

from __future__ import annotations

import copy

import torch
from tests.e2e.tiny_models import tiny_model

import fxrewrite
from fxrewrite.benchmarks.saved_tensors import saved_tensor_bytes


def test_optimize_saves_less_than_stock(monkeypatch):
    monkeypatch.setenv("FXREWRITE_TRITON", "1")  # the Triton training functions, in the interpreter
    stock = tiny_model("qwen3", num_hidden_layers=1).train()
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    ids = torch.randint(3, 96, (2, 32), generator=torch.Generator().manual_seed(0))
    got = {name: saved_tensor_bytes(m(ids, labels=ids).loss, m.parameters()) for name, m in
           (("stock", stock), ("optimize", fused))}
    assert {"RMSNormFunctionBackward", "ActAndMulDownFunctionBackward"} <= set(got["optimize"])
    # the gated activation + down projection keeps its [tokens, 2 * intermediate] input and nothing else
    assert got["optimize"]["ActAndMulDownFunctionBackward"] == 2 * 32 * 2 * 48 * 4
    assert sum(got["optimize"].values()) < sum(got["stock"].values())
    assert "NllLossBackward0" in got["stock"] and "NllLossBackward0" not in got["optimize"]  # no logits kept
