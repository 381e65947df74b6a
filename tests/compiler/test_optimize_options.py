"""optimize()'s options checked before anything changes: a bad `patterns` or `example_inputs` is a TypeError naming
the value and what was expected, and the model is left as it was. Before, `patterns=["qkv"]` failed deep inside the
matcher (AttributeError: 'str' object has no attribute 'name'), and a malformed `example_inputs` raised from the
meta run's unpacking after its recording hooks were registered: every module kept a forward pre-hook, so the
corrected optimize() refused every fusion ("hooks ... would be lost by the fusion")."""

import pytest
import torch

import fxrewrite
from fxrewrite.patterns import PATTERNS
from fxrewrite.patterns.qkv import QKVPattern

from tests.e2e.tiny_models import tiny_model


def _untouched(model):
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert not hasattr(model, "_fxrewrite_report") and not hasattr(model, "_fxrewrite_hf_param_names")


@pytest.mark.parametrize("patterns,shown", [(["qkv"], "'qkv' \\(str\\)"), ("qkv", "'qkv' \\(str\\)"),
                                            (None, "None"), ((QKVPattern, "glu"), "'glu'")])
def test_bad_patterns_name_the_value(patterns, shown):
    model = tiny_model("llama")
    with pytest.raises(TypeError, match=r"optimize\(patterns=\.\.\.\) expects .*Pattern subclasses.*got " + shown):
        fxrewrite.optimize(model, patterns=patterns)
    _untouched(model)


@pytest.mark.parametrize("example_inputs", [5, (torch.zeros(1, 4, dtype=torch.long),), (torch.zeros(1, 4), {}),
                                            ((), [("input_ids", None)])])
def test_bad_example_inputs_name_the_value_and_leave_no_hooks(example_inputs):
    model = tiny_model("llama")
    with pytest.raises(TypeError, match=r"optimize\(example_inputs=\.\.\.\) expects \(args, kwargs\).*got "):
        fxrewrite.optimize(model, example_inputs=example_inputs)
    _untouched(model)
    fxrewrite.optimize(model)  # the corrected call fuses as usual
    assert fxrewrite.explain(model).skipped() == []


def test_good_options_still_work():
    ids = torch.zeros(1, 4, dtype=torch.long)
    model = fxrewrite.optimize(tiny_model("llama"), patterns=list(PATTERNS[:3]), example_inputs=([ids], {}))
    assert fxrewrite.explain(model).applied_patterns() == ["qkv", "rms_norm", "rotary"]


def test_explain_of_something_that_is_not_a_module_is_a_type_error():
    with pytest.raises(TypeError, match="explain expects the nn.Module fxrewrite.optimize returned, got int 5"):
        fxrewrite.explain(5)
    with pytest.raises(TypeError, match="use the CLI: fxrewrite explain MODEL"):
        fxrewrite.explain("/no/such")
    with pytest.raises(ValueError, match="Linear has not been passed through fxrewrite.optimize"):
        fxrewrite.explain(torch.nn.Linear(2, 2))
