"""A malformed or misplaced quantization_config (config.json or hf_overrides) is one clear error before any weight
is read or worker started, naming the value and what was expected (fresh-user report: tracebacks, a silently
dropped override, a pattern string split into characters, "checkpoint is missing ... weight_scale_inv")."""

from __future__ import annotations

import pytest

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.model_files.quantization import resolve_quantization

FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}


def _llm(path, **kwargs):
    from fxrewrite.runtime.llm import LLM

    return LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 20, **kwargs)


class _Config:
    def __init__(self, qc):
        self.quantization_config = qc


@pytest.mark.parametrize("block", [128, [True, True], [128], "128x128", [128, 0]])
def test_a_weight_block_size_that_is_not_two_positive_ints_is_refused(block):
    with pytest.raises(UserInputError, match=r"weight_block_size=.* must be two positive integers, e\.g\. \[128, 128\]"):
        resolve_quantization(None, _Config({**FP8, "weight_block_size": block}))


def test_one_string_is_one_module_pattern():
    quant = resolve_quantization(None, _Config({**FP8, "weight_block_size": [128, 128],
                                                "modules_to_not_convert": "mlp.down_proj"}))
    assert quant.modules_to_not_convert == ("mlp.down_proj",)
    with pytest.raises(UserInputError, match=r"ignored_layers=3 must be a list of module-name patterns"):
        resolve_quantization(None, _Config({**FP8, "weight_block_size": [128, 128], "ignored_layers": 3}))


def test_a_quantization_config_override_that_is_not_an_object_is_refused(tiny_qwen3_dir):
    with pytest.raises(UserInputError, match=r"hf_overrides\['quantization_config'\] must be a JSON object .* got 'fp8'"):
        _llm(tiny_qwen3_dir, hf_overrides={"quantization_config": "fp8"})


def test_an_fp8_override_on_float_weights_points_to_quantization_fp8(tiny_qwen3_dir, monkeypatch):
    import fxrewrite.runtime.engine.llm_engine as llm_engine

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the check")

    monkeypatch.setattr(llm_engine, "create_model_runner", no_model)
    overrides = {"quantization_config": {**FP8, "weight_block_size": [128, 128]}}
    with pytest.raises(UserInputError, match=r"have no \*_scale_inv tensors: they are not FP8\. To quantize float "
                                             r"weights at load pass quantization='fp8' .*load_format='dummy'"):
        _llm(tiny_qwen3_dir, hf_overrides=overrides)
