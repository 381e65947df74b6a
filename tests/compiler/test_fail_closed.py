"""The compiler fails closed on pattern builds (issue 15 items 10 and 11): a build that raises
leaves the module exactly as it was, and no module-scope match is dropped without a report line."""

import dataclasses

import torch

import fxrewrite
from fxrewrite.patterns import PATTERNS
from fxrewrite.patterns.qkv import QKVPattern
from fxrewrite.patterns.rms_norm import RMSNormPattern
from fxrewrite.patterns.rotary import RotaryApplyPattern

from tests.e2e.tiny_models import tiny_model


class _FailingApply(RotaryApplyPattern):
    """rotary_apply whose build raises (runs after QKV's build on the same attention instance)."""

    name = "failing_apply"

    @classmethod
    def build(cls, match, module, ctx):
        raise RuntimeError("injected build failure")


def _state(module):
    return ({n: type(c) for n, c in module.named_children()},
            {n: p.data_ptr() for n, p in module.named_parameters()}, type(module).forward)


def test_failing_build_leaves_the_module_as_it_was():
    model = tiny_model("llama")
    ids = torch.randint(0, 96, (1, 7))
    with torch.no_grad():
        want = model(ids).logits
    attn = model.model.layers[0].self_attn
    before = _state(attn)
    fxrewrite.optimize(model, patterns=(QKVPattern, _FailingApply))
    assert _state(attn) == before  # q_proj/k_proj/v_proj still there, the same parameters, no qkv_proj
    assert "forward" not in attn.__dict__  # no rewritten forward bound
    report = fxrewrite.explain(model).classes["LlamaAttention"]
    assert "qkv" not in report.applied and "failing_apply" not in report.applied
    reasons = dict(report.skipped)
    assert "injected build failure" in reasons["failing_apply"] and "left as it was" in reasons["failing_apply"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)


class _SecondNorm(RMSNormPattern):
    """A second module-scope match on the same class, on fx nodes of its own (so only the
    compiler's handling of module-scope matches, not the disjointness check, decides)."""

    name = "rms_norm_again"

    @classmethod
    def match(cls, traced, ctx):
        return [dataclasses.replace(m, pattern=cls, claimed=frozenset(f"{cls.name}:{n}" for n in m.claimed))
                for m in super().match(traced, ctx)]


class _BrokenNorm(_SecondNorm):
    name = "rms_norm_broken"

    @classmethod
    def build(cls, match, module, ctx):
        raise RuntimeError("injected build failure")


def test_every_module_scope_match_gets_a_report_line():
    model = fxrewrite.optimize(tiny_model("llama"), patterns=(RMSNormPattern, _SecondNorm))
    entry = fxrewrite.explain(model).classes["LlamaRMSNorm"]
    assert "rms_norm" in entry.applied
    assert ("rms_norm_again", "the module is already replaced by rms_norm") in entry.skipped


def test_module_scope_falls_through_to_the_next_match_when_a_build_fails():
    model = tiny_model("llama")
    ids = torch.randint(0, 96, (1, 5))
    with torch.no_grad():
        want = model(ids).logits
    fxrewrite.optimize(model, patterns=(_BrokenNorm, RMSNormPattern))
    entry = fxrewrite.explain(model).classes["LlamaRMSNorm"]
    assert "rms_norm" in entry.applied and "injected build failure" in dict(entry.skipped)["rms_norm_broken"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_default_patterns_still_apply():
    model = fxrewrite.optimize(tiny_model("llama"), patterns=PATTERNS)
    assert "qkv" in fxrewrite.explain(model).applied_patterns()
