"""Sliding-window attention under ``torch.compile`` in training: loss and gradients of an optimized model equal stock
transformers' (float32, CPU).

``fxrewrite_sdpa`` (fxrewrite/layers/sdpa_causal.py) drops the mask while compiling only where it can only be the
plain causal one; a sliding-window mask (``local_size``, ``sliding_window_causal_mask_function``) must be kept. With
window 4 and 11 tokens, a dropped window attends to up to 7 more keys per query: the loss and every gradient change.
Mistral attends through ``fxrewrite_sdpa`` (every layer sliding); Gemma2 (layers alternate sliding / full) attends
eagerly in transformers (it refuses SDPA), so its sliding layer's mask comes from the eager mask path.
"""

from __future__ import annotations

import pytest
import torch
from tests.e2e.tiny_models import tiny_model

import fxrewrite
from fxrewrite.layers.sdpa_causal import SDPA_CAUSAL
from fxrewrite.weights import to_hf_names

WINDOW, SEQ = 4, 11
_SDPA = torch._C._nn.scaled_dot_product_attention


def _step(runner, model, ids, labels):
    model.zero_grad()
    loss = runner(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_compiled_sliding_window_training_matches_stock(arch):
    stock = tiny_model(arch, sliding_window=WINDOW, use_cache=False).train()
    fused = fxrewrite.optimize(tiny_model(arch, sliding_window=WINDOW, use_cache=False).train()).train()
    assert fused.config.sliding_window == WINDOW
    if arch == "mistral":
        assert fused.config._attn_implementation == SDPA_CAUSAL  # the path whose causal-mask skip is under test
    ids = torch.randint(3, 96, (2, SEQ), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :2] = -100

    want_loss, want_grads = _step(stock, stock, ids, labels)
    # the window matters here, far beyond the tolerances below: without it (window past the sequence) stock's logits
    # move by more than 1e-3
    with torch.no_grad():
        windowed = stock(input_ids=ids).logits
        wide = tiny_model(arch, sliding_window=SEQ + 1, use_cache=False).train()(input_ids=ids).logits
    assert float((wide - windowed).abs().max()) > 1e-3

    masks = []

    def backend(gm, example_inputs):  # aot_eager, noting the attn_mask of every SDPA call dynamo traced
        from torch._dynamo.backends.debugging import aot_eager

        masks.extend(n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)
                     for n in gm.graph.nodes if n.target is _SDPA)
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    try:
        got_loss, got_grads = _step(torch.compile(fused, backend=backend), fused, ids, labels)
    finally:
        torch._dynamo.reset()
    if arch == "mistral":  # both layers slide: no SDPA call may run without its mask
        assert len(masks) == 2 and all(m is not None for m in masks), masks

    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    got_grads = to_hf_names(fused, got_grads)
    assert set(got_grads) == set(want_grads)
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-5, msg=name)
