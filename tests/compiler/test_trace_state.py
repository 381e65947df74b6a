"""Tracing leaves every tensor a module holds as it was (issue 15 item 1).

transformers' longrope / dynamic rotary update runs during the meta-device run and used to leave
`long_inv_freq` as a meta tensor, so the optimized model failed with "Cannot copy out of meta tensor".
"""

import pytest
import torch
import transformers as T

import fxrewrite
from fxrewrite import tracer
from tests.e2e.tiny_models import tiny_model

LONGROPE = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.5 * i for i in range(8)]}
MODELS = {
    "phi3-longrope": ("phi3", {"max_position_embeddings": 256, "original_max_position_embeddings": 64,
                               "hidden_size": 64, "rope_parameters": LONGROPE}),
    "llama-dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}),
    "qwen3": ("qwen3", {}),
    "llama": ("llama", {}),
}


def _all_tensors(model):
    """(module name, kind, key) -> tensor, for parameters, buffers and plain tensor attributes."""
    out = {}
    for name, module in model.named_modules():
        for kind, held in (("param", module._parameters), ("buffer", module._buffers),
                           ("plain", {k: v for k, v in module.__dict__.items() if isinstance(v, torch.Tensor)})):
            for key, value in held.items():
                if value is not None:
                    out[(name, kind, key)] = value
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_tracing_keeps_every_tensor(name):
    arch, overrides = MODELS[name]
    model = tiny_model(arch, **overrides)
    with torch.no_grad():  # a long run first: the rotary module holds its long-context state
        model(torch.randint(3, 96, (1, 100)))
    before = _all_tensors(model)
    values = {k: v.detach().clone() for k, v in before.items()}
    records, error = tracer.record_inputs(model)
    assert error is None
    for module, args, kwargs in records.values():
        tracer.trace(module, args, kwargs)
    after = _all_tensors(model)
    assert after.keys() == before.keys()
    for key, tensor in before.items():
        assert after[key] is tensor, key
        assert not tensor.is_meta and torch.equal(tensor, values[key]), key


def test_optimize_longrope_model_runs():
    arch, overrides = MODELS["phi3-longrope"]
    ref, model = tiny_model(arch, **overrides), tiny_model(arch, **overrides)
    fxrewrite.optimize(model)
    for length in (10, 100):  # short factors, then long ones
        ids = torch.randint(3, 96, (1, length))
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    assert not any(t.is_meta for t in _all_tensors(model).values())
