"""RoPE overrides on composite configs, overrides without rope_type, the original-length warning
(issue 15 items 4, 6 and 18)."""

import warnings

import pytest
from transformers import LlamaConfig, Qwen3Config, Qwen3VLConfig

from fxrewrite.layers.rope_init import RopeConfigWarning, validate_rope_parameters
from fxrewrite.runtime.model_files.config import ModelConfig

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, head_dim=16, max_position_embeddings=4096)
MROPE = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
YARN2 = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096}


@pytest.fixture(autouse=True)
def _no_escape_env(monkeypatch):
    monkeypatch.delenv("FXREWRITE_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)


@pytest.fixture
def qwen3_vl_dir(tmp_path):
    """A Qwen3-VL-style composite config: the language model's rope (with mrope keys) in text_config."""
    config = Qwen3VLConfig(text_config=dict(TEXT, rope_parameters=dict(MROPE)),
                           architectures=["Qwen3VLForConditionalGeneration"])
    config.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("overrides", [
    {"rope_scaling": dict(YARN2)},
    {"rope_parameters": dict(YARN2)},
    {"text_config": {"rope_parameters": dict(YARN2)}},
    {"text_config": {"rope_scaling": dict(YARN2)}},
])
def test_composite_config_takes_rope_override(qwen3_vl_dir, overrides):
    assert ModelConfig.from_pretrained(qwen3_vl_dir).max_model_len == 4096
    mc = ModelConfig.from_pretrained(qwen3_vl_dir, hf_overrides=overrides)
    rope = mc.hf_config.get_text_config().rope_parameters
    assert mc.hf_text_config is mc.hf_config.get_text_config()
    assert rope["rope_type"] == "yarn" and rope["factor"] == 2.0
    assert rope["mrope_section"] == [2, 3, 3] and rope["mrope_interleaved"] is True  # the checkpoint's keys
    assert rope["rope_theta"] == 5e6
    assert mc.rope_parameters["rope_type"] == "yarn"
    assert mc.max_model_len == 8192  # the derived length follows the override


def test_rope_override_without_type_is_an_error(tmp_path_factory, qwen3_vl_dir):
    tmp_path = tmp_path_factory.mktemp("llama")
    LlamaConfig(**TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e4}).save_pretrained(tmp_path)
    for key in ("rope_parameters", "rope_scaling"):
        with pytest.raises(ValueError, match=r"'rope_type'.*missing|missing.*'rope_type'"):
            ModelConfig.from_pretrained(tmp_path, hf_overrides={key: {"factor": 2.0}})
    with pytest.raises(ValueError, match="rope_type"):
        ModelConfig.from_pretrained(qwen3_vl_dir, hf_overrides={"text_config": {"rope_parameters": {"factor": 2.0}}})
    # Model facts alone (no scaling) stay legal: the checkpoint's default rope with a new theta.
    mc = ModelConfig.from_pretrained(tmp_path, hf_overrides={"rope_parameters": {"rope_theta": 5e5}})
    assert mc.rope_parameters == {"rope_type": "default", "rope_theta": 5e5}


def test_qwen3_yarn_recipe_gives_no_warning(tmp_path):
    """Qwen3's documented YaRN recipe: factor 4, original 32768, on max_position_embeddings 40960."""
    Qwen3Config(**TEXT | {"max_position_embeddings": 40960}, rope_theta=1e6).save_pretrained(tmp_path)
    recipe = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RopeConfigWarning)
        mc = ModelConfig.from_pretrained(tmp_path, hf_overrides={"rope_parameters": recipe})
    assert mc.max_model_len == 131072


def test_original_length_past_max_position_warns():
    """An original length longer than the model's own context is likely a mistake: say so, truthfully."""
    params = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 65536}
    with pytest.warns(RopeConfigWarning, match="65536.*larger than.*max_position_embeddings=32768"):
        validate_rope_parameters(params, 64, 32768)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RopeConfigWarning)
        validate_rope_parameters(dict(params, original_max_position_embeddings=32768), 64, 40960)
        validate_rope_parameters(dict(params, original_max_position_embeddings=32768), 64, 131072)
