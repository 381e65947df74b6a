"""Optimizers that read each tensor whole (Adafactor, Muon...) step differently over a merged q/k/v or gate/up
Parameter than over the stock model's separate ones (the gradients are equal): their first step over a merged
parameter warns, naming the fix, and ``optimize(merge_weights=False)`` keeps the parameters apart, so the same
optimizer then trains exactly as on the stock model (the other fusions stay)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from tests.e2e.tiny_models import tiny_model
from transformers.optimization import Adafactor

import fxrewrite

_OPTIMIZERS = {
    "adafactor-transformers": lambda ps: Adafactor(ps, lr=1e-2, scale_parameter=False, relative_step=False),
    "adafactor-torch": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
}
if hasattr(torch.optim, "Muon"):
    _OPTIMIZERS["muon"] = lambda ps: torch.optim.Muon([p for p in ps if p.ndim == 2], lr=0.02)
# Muon orthogonalises in bfloat16: the fused kernels' float32 rounding (~1e-7 in the gradients) can flip a bf16
# rounding that its Newton-Schulz iterations amplify (torch 2.13's CPU build: 3% of the largest update in one element
# after one step; over a merged q/k/v or gate/up the update differs by 36-70%). So it is compared after one step, each
# tensor within a tenth of its largest update.
_STEPS = {"muon": 1}
_UPDATE_TOLERANCE = {"muon": 0.1}


def _train(model, make_optimizer, steps=2):
    model.train()
    optimizer = make_optimizer(list(model.parameters()))
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            optimizer.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
    return model.state_dict(), [str(w.message) for w in caught if "merge_weights=False" in str(w.message)]


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_per_tensor_optimizers_warn_and_merge_weights_false_trains_like_stock(name):
    make = _OPTIMIZERS[name]
    stock = tiny_model("qwen3", tie_word_embeddings=False)
    merged = fxrewrite.optimize(copy.deepcopy(stock))
    separate = fxrewrite.optimize(copy.deepcopy(stock), merge_weights=False)
    steps = _STEPS.get(name, 2)
    before = {key: value.clone() for key, value in stock.state_dict().items()}
    want, _ = _train(stock, make, steps)
    got_merged, merged_warnings = _train(merged, make, steps)
    got_separate, separate_warnings = _train(separate, make, steps)
    assert len(merged_warnings) == 1 and "qkv_proj.weight (q_proj, k_proj, v_proj)" in merged_warnings[0]
    assert not separate_warnings
    q = "model.layers.0.self_attn.q_proj.weight"
    share = _UPDATE_TOLERANCE.get(name)
    for key, value in want.items():
        if share is None:
            torch.testing.assert_close(got_separate[key], value, rtol=1e-5, atol=1e-6, msg=key)
        else:
            largest = (value - before[key]).abs().max()
            assert (got_separate[key] - value).abs().max() <= share * largest, key
    assert not torch.allclose(got_merged[q], want[q], rtol=1e-4, atol=1e-6)  # what the warning is about
    if share is not None:
        assert (got_merged[q] - want[q]).abs().max() > 3 * share * (want[q] - before[q]).abs().max()
    report = fxrewrite.explain(separate)
    assert {"qkv", "glu"}.isdisjoint(report.applied_patterns()) and {"rms_norm", "rotary"} <= set(
        report.applied_patterns())
    assert any("merge_weights=False: q_proj, k_proj, v_proj stay separate parameters" in reason
               for _, _, reason in report.skipped())


def test_elementwise_optimizers_do_not_warn():
    model = fxrewrite.optimize(tiny_model("llama"))
    for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-3), lambda ps: torch.optim.SGD(ps, lr=1e-2)):
        assert _train(model, make, steps=1)[1] == []


def test_a_second_optimize_with_other_options_is_refused_and_the_same_options_are_a_no_op():
    """optimize(model, merge_weights=False) on a model already optimized merged cannot split it again: a
    ValueError naming both option sets (before, the call returned the merged model silently)."""
    from fxrewrite.patterns import PATTERNS

    model = fxrewrite.optimize(tiny_model("llama"))
    assert fxrewrite.optimize(model) is model and fxrewrite.optimize(model, merge_weights=True) is model
    with pytest.raises(ValueError, match=r"already optimized with .*merge_weights=True; asked again with "
                                         r".*merge_weights=False"):
        fxrewrite.optimize(model, merge_weights=False)
    with pytest.raises(ValueError, match="optimize a freshly loaded model"):
        fxrewrite.optimize(model, patterns=PATTERNS[:1])
    clone = copy.deepcopy(model)
    assert fxrewrite.optimize(clone) is clone
    instances = fxrewrite.optimize(tiny_model("llama"), patterns=[p() for p in PATTERNS])
    again = copy.deepcopy(instances)  # new pattern instances of the same classes: the same options
    assert fxrewrite.optimize(again, patterns=[p() for p in PATTERNS]) is again


def test_merge_weights_must_be_a_bool():
    with pytest.raises(TypeError, match=r"optimize\(merge_weights=\.\.\.\) expects True or False, got 'no'"):
        fxrewrite.optimize(tiny_model("llama"), merge_weights="no")


@pytest.mark.parametrize("merge_weights", [True, False])
def test_an_optimizer_built_before_optimize_is_refused(merge_weights):
    """Built before optimize, an optimizer holds the Parameters the fused layers replaced (q/k/v, gate/up, norms):
    it would step tensors the model no longer uses. Its first step raises, naming one and the fix."""
    model = tiny_model("qwen3")
    stale = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fxrewrite.optimize(model, merge_weights=merge_weights)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(8))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match=r"AdamW holds \d+ parameter\(s\) that fxrewrite.optimize replaced .*"
                                           r"Build the optimizer after fxrewrite.optimize\(model\)"):
        stale.step()
    with pytest.raises(RuntimeError, match="Build the optimizer after"):  # again: a caught error does not let it pass
        stale.step()
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    fresh.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True) if p.grad is not None)
