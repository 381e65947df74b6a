"""A malformed or misplaced quantization_config (config.json or hf_overrides) is one clear error before any weight
is read or worker started, naming the value and what was expected (fresh-user report: tracebacks, a silently
dropped override, a pattern string split into characters, "checkpoint is missing ... weight_scale_inv")."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("qc", ["fp8", [], 5])
def test_a_quantization_config_that_is_not_an_object_is_refused(qc):
    with pytest.raises(UserInputError, match=r"quantization_config is .*; expected an object such as"):
        resolve_quantization(None, _Config(qc))


def test_an_fp8_weight_stored_as_integers_is_refused(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    from fxrewrite.runtime.model_files.fp8_checkpoint import write_fp8_checkpoint

    src = tiny_model_dir("qwen3", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=512, vocab="smollm2")
    folder = write_fp8_checkpoint(src, tmp_path / "fp8")
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].view(torch.int8)  # the same bytes, read as integers
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserInputError, match=r"down_proj.weight \(shard None\) is stored as (I8|torch.int8); an FP8 "):
        _llm(folder)
