"""ModelConfig: hf_overrides, legacy rope, max_model_len, dtype (issue 2, items 3 and 4)."""

import json
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3Config, LlamaConfig, Qwen3Config

from fxrewrite.errors import UserInputError
from fxrewrite.layers.rotary import get_rope
from fxrewrite.runtime.model_files.config import ModelConfig
from fxrewrite.runtime.model_files.hf_config import derive_max_model_len, verify_max_model_len

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128)
SEED_OVERRIDES = {
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "yarn", "factor": 4.0,
                        "original_max_position_embeddings": 32768},
    "max_model_len": 131072,
}


@pytest.fixture(autouse=True)
def _no_escape_env(monkeypatch):
    monkeypatch.delenv("FXREWRITE_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)


@pytest.fixture
def qwen3_dir(tmp_path):
    """Qwen3 config (Qwen3-0.6B's rope and lengths, tiny sizes) written with save_pretrained."""
    config = Qwen3Config(**TINY, head_dim=32, max_position_embeddings=32768, rope_theta=1e6,
                         architectures=["Qwen3ForCausalLM"], dtype="bfloat16")
    config.save_pretrained(tmp_path)
    return tmp_path


def write_config(path, config, **edits):
    config.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw.update(edits)
    raw = {k: v for k, v in raw.items() if v is not None or k not in edits}
    (path / "config.json").write_text(json.dumps(raw))
    return path


# --- the seed example -------------------------------------------------------------------------

def test_seed_example_yarn_131072(qwen3_dir):
    mc = ModelConfig.from_pretrained(qwen3_dir, hf_overrides=SEED_OVERRIDES)
    assert mc.max_model_len == 131072
    assert mc.rope_parameters["rope_type"] == "yarn" and mc.rope_parameters["factor"] == 4.0
    assert mc.hf_config.rope_parameters["rope_type"] == "yarn"
    assert mc.architectures == ["Qwen3ForCausalLM"] and mc.head_dim == 32 and mc.num_key_value_heads == 2
    # The overridden config is what transformers builds its model from...
    model = AutoModelForCausalLM.from_config(mc.hf_config)
    rotary = model.model.rotary_emb
    assert rotary.rope_type == "yarn"
    # ...and our rotary, built from ModelConfig.rope_parameters, equals it past the original length.
    ours = get_rope(mc.head_dim, mc.hf_text_config.max_position_embeddings, mc.rope_parameters)
    positions = torch.tensor([0, 1, 32767, 32768, 100000, 131071])
    hf_cos, hf_sin = rotary(torch.zeros(1), positions[None])
    cos, sin = ours.get_cos_sin(positions)
    torch.testing.assert_close(cos, hf_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0], atol=1e-6, rtol=0)


def test_seed_example_131073_raises_naming_values_and_key(qwen3_dir):
    with pytest.raises(ValueError) as info:
        ModelConfig.from_pretrained(qwen3_dir, hf_overrides=SEED_OVERRIDES, max_model_len=131073)
    msg = str(info.value)
    assert "131073" in msg and "131072" in msg and "original_max_position_embeddings" in msg
    assert "FXREWRITE_ALLOW_LONG_MAX_MODEL_LEN" in msg


@pytest.mark.parametrize("env", ["FXREWRITE_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"])
def test_seed_example_escape_variable_warns_and_proceeds(qwen3_dir, monkeypatch, env):
    monkeypatch.setenv(env, "1")
    overrides = {**SEED_OVERRIDES, "max_model_len": 131073}
    with pytest.warns(UserWarning, match="NaN") as record:
        mc = ModelConfig.from_pretrained(qwen3_dir, hf_overrides=overrides)
    assert mc.max_model_len == 131073
    assert any("131072" in str(w.message) for w in record)


def test_explicit_max_model_len_wins_over_override_key(qwen3_dir):
    mc = ModelConfig.from_pretrained(qwen3_dir, hf_overrides=SEED_OVERRIDES, max_model_len=4096)
    assert mc.max_model_len == 4096 and mc.derived_max_model_len == 131072


# --- hf_overrides forms ------------------------------------------------------------------------

def test_flat_override_changes_loaded_config(qwen3_dir):
    mc = ModelConfig.from_pretrained(qwen3_dir, hf_overrides={"max_position_embeddings": 1000, "rope_theta": 5e5})
    assert mc.hf_config.max_position_embeddings == 1000 and mc.max_model_len == 1000
    assert mc.rope_parameters["rope_theta"] == 5e5  # transformers alone would keep config.json's value
    assert mc.hf_config.rope_parameters["rope_theta"] == 5e5


def test_nested_rope_parameters_replace_whole(tmp_path):
    config = LlamaConfig(**TINY, max_position_embeddings=4096, rope_theta=5e5,
                         rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})
    write_config(tmp_path, config)
    assert ModelConfig.from_pretrained(tmp_path).max_model_len == 8192
    mc = ModelConfig.from_pretrained(tmp_path, hf_overrides={"rope_parameters": {"rope_type": "default"}})
    assert "factor" not in mc.hf_config.rope_parameters  # replaced whole, not merged
    assert mc.rope_parameters == {"rope_type": "default", "rope_theta": 5e5}  # the model's theta is kept
    assert mc.max_model_len == 4096


def test_nested_dict_merges_into_sub_config(tmp_path):
    text = dict(TINY, head_dim=16, num_key_value_heads=2, max_position_embeddings=8192, sliding_window=512)
    Gemma3Config(text_config=text, architectures=["Gemma3ForConditionalGeneration"]).save_pretrained(tmp_path)
    mc = ModelConfig.from_pretrained(tmp_path, hf_overrides={"text_config": {"max_position_embeddings": 2048}})
    assert mc.hf_text_config.max_position_embeddings == 2048 and mc.max_model_len == 2048
    assert mc.hf_text_config.sliding_window == 512  # merged: the rest of the sub-config stays
    # Gemma 3 keeps per-layer-type rope parameters: flat view is full_attention's, nothing crashes.
    assert set(mc.rope_parameters_by_layer_type) == {"full_attention", "sliding_attention"}
    assert mc.rope_parameters == mc.rope_parameters_by_layer_type["full_attention"]


def test_callable_override_runs(qwen3_dir):
    def shrink(config):
        config.max_position_embeddings = 777
        return config

    assert ModelConfig.from_pretrained(qwen3_dir, hf_overrides=shrink).max_model_len == 777
    with pytest.raises(TypeError, match="PretrainedConfig"):
        ModelConfig.from_pretrained(qwen3_dir, hf_overrides=lambda config: None)


def test_json_string_override_equals_dict(qwen3_dir):
    mc = ModelConfig.from_pretrained(qwen3_dir, hf_overrides=json.dumps(SEED_OVERRIDES))
    assert mc.max_model_len == 131072 and mc.rope_parameters["rope_type"] == "yarn"


@pytest.mark.parametrize("text", ['{"rope_parameters": {', "[1, 2]", "max_model_len=4"])
def test_bad_json_is_a_clear_error(qwen3_dir, text):
    with pytest.raises(ValueError, match="must be a JSON object") as info:
        ModelConfig.from_pretrained(qwen3_dir, hf_overrides=text)
    assert text.split(",")[0] in str(info.value)


def test_override_of_wrong_kind_is_type_error(qwen3_dir):
    with pytest.raises(TypeError, match="hf_overrides"):
        ModelConfig.from_pretrained(qwen3_dir, hf_overrides=42)


# --- legacy rope and validation through the config --------------------------------------------

def test_legacy_rope_scaling_and_top_level_theta(tmp_path):
    write_config(tmp_path, LlamaConfig(**TINY, max_position_embeddings=16384), rope_parameters=None,
                 rope_theta=5e5, rope_scaling={"type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 4096})
    mc = ModelConfig.from_pretrained(tmp_path)
    assert mc.rope_parameters["rope_type"] == "yarn" and mc.rope_parameters["rope_theta"] == 5e5
    assert "type" not in mc.rope_parameters
    assert mc.max_model_len == 16384


def test_rope_scaling_override_keeps_model_theta(qwen3_dir):
    mc = ModelConfig.from_pretrained(qwen3_dir, hf_overrides={"rope_scaling": {"type": "linear", "factor": 2.0}})
    assert mc.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    assert mc.max_model_len == 65536


def test_config_json_missing_rope_key_is_value_error(tmp_path):
    write_config(tmp_path, LlamaConfig(**TINY), rope_parameters={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="llama3"):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("rope, match", [
    ({"rope_type": "yarn", "original_max_position_embeddings": 4096}, "'factor'"),
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 4096}, "'low_freq_factor'"),
    ({"rope_type": "ntk-by-parts"}, "supported rope types are default, linear, dynamic, yarn, llama3, longrope"),
    ({"rope_type": "linear", "factor": 0.5}, "factor.*>= 1"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 16,
      "original_max_position_embeddings": 4096}, "short_factor.*16.*got 3"),
    # issue 2, item 5: each remaining required key and bad value, by message
    ({"rope_type": "yarn", "factor": 4.0}, "rope_type='yarn' need 'original_max_position_embeddings'"),
    ({"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 4096}, "rope_type='llama3' need 'factor'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
      "original_max_position_embeddings": 4096}, "rope_type='llama3' need 'high_freq_factor'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     "rope_type='llama3' need 'original_max_position_embeddings'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 4096}, "high_freq_factor > low_freq_factor"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [1.0] * 15,
      "original_max_position_embeddings": 4096}, "long_factor.*16.*got 15"),
    ({"rope_type": "longrope", "long_factor": [1.0] * 16, "original_max_position_embeddings": 4096},
     "rope_type='longrope' need 'short_factor'"),
    ({"rope_type": "dynamic"}, "rope_type='dynamic' need 'factor'"),
    ({"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 4096}, "'factor'.*'yarn'.*>= 1.*0.5"),
    ({"rope_type": "default", "partial_rotary_factor": 1.5}, r"partial_rotary_factor.*\(0, 1\].*1.5"),
])
def test_rope_validation_errors_through_overrides(qwen3_dir, rope, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_pretrained(qwen3_dir, hf_overrides={"rope_parameters": rope})


def test_original_max_position_mismatch_warns(qwen3_dir):
    rope = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 65536}
    with pytest.warns(UserWarning, match="original_max_position_embeddings.*65536.*32768"):
        ModelConfig.from_pretrained(qwen3_dir, hf_overrides={"rope_parameters": rope})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the seed's advice followed: no warning
        rope["original_max_position_embeddings"] = 32768
        ModelConfig.from_pretrained(qwen3_dir, hf_overrides={"rope_parameters": rope})


# --- max_model_len derivation and dtype ---------------------------------------------------------

def test_derivation_rules():
    cfg = LlamaConfig(**TINY, max_position_embeddings=4096)
    assert derive_max_model_len(cfg) == (4096, "max_position_embeddings=4096")
    assert derive_max_model_len(cfg, tokenizer_model_max_length=1000)[0] == 1000
    with pytest.raises(UserInputError, match=r"\(from the tokenizer config: model_max_length=1000\)") as tok:
        verify_max_model_len(2000, *derive_max_model_len(cfg, tokenizer_model_max_length=1000))
    assert "to extend the context" not in str(tok.value)  # RoPE scaling does not lift the tokenizer's limit
    with pytest.raises(UserInputError, match=r"a limit of the tokenizer config, which scaling RoPE does not lift; "
                                             r"the model config's own positions reach 4096\)"):
        verify_max_model_len(2000, *derive_max_model_len(cfg, tokenizer_model_max_length=1000), 4096)
    with pytest.raises(UserInputError, match=r"past the model config's own limit, scale RoPE too"):
        verify_max_model_len(5000, *derive_max_model_len(cfg, tokenizer_model_max_length=1000), 4096)
    with pytest.MonkeyPatch.context() as mp:  # allowed: past the tokenizer's limit only is not "garbage"
        mp.setenv("FXREWRITE_ALLOW_LONG_MAX_MODEL_LEN", "1")
        with pytest.warns(UserWarning, match="model config's own positions reach 4096") as caught:
            assert verify_max_model_len(2000, *derive_max_model_len(cfg, tokenizer_model_max_length=1000), 4096) == 2000
        assert "garbage" not in str(caught[0].message)
        with pytest.warns(UserWarning, match="positions past 4096 give NaN or garbage"):
            verify_max_model_len(5000, *derive_max_model_len(cfg, tokenizer_model_max_length=1000), 4096)
    with pytest.raises(UserInputError, match=r"\(from the model config: max_position_embeddings=4096\).*scale RoPE"):
        verify_max_model_len(5000, *derive_max_model_len(cfg))
    cfg.max_seq_len = 3000  # the minimum over the length keys wins
    assert derive_max_model_len(cfg) == (3000, "max_seq_len=3000")
    llama3 = LlamaConfig(**TINY, max_position_embeddings=131072, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 5e5})
    assert derive_max_model_len(llama3)[0] == 131072  # llama3 lengths are already scaled
    dynamic = LlamaConfig(**TINY, max_position_embeddings=2048,
                          rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    assert derive_max_model_len(dynamic)[0] == 4096
    windowed = Qwen3Config(**TINY, max_position_embeddings=4096, sliding_window=1024, use_sliding_window=True)
    assert derive_max_model_len(windowed)[0] == 4096
    assert derive_max_model_len(windowed, disable_sliding_window=True) == (1024, "sliding_window=1024")
    # RoPE scaling extends the model's positions; the tokenizer's limit and a disabled window's still bound it
    yarn = Qwen3Config(**TINY, max_position_embeddings=4096, sliding_window=1024, use_sliding_window=True,
                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                                        "rope_theta": 1e6})
    assert derive_max_model_len(yarn) == (16384, "original_max_position_embeddings=4096 * rope factor 4.0")
    assert derive_max_model_len(yarn, tokenizer_model_max_length=512) == (512, "tokenizer model_max_length=512")
    assert derive_max_model_len(yarn, disable_sliding_window=True) == (1024, "sliding_window=1024")
    assert derive_max_model_len(dynamic, tokenizer_model_max_length=3000)[0] == 3000


def test_tokenizer_model_max_length_bounds(qwen3_dir):
    (qwen3_dir / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))
    mc = ModelConfig.from_pretrained(qwen3_dir)
    assert mc.max_model_len == 2048
    with pytest.raises(ValueError, match="model_max_length"):
        ModelConfig.from_pretrained(qwen3_dir, max_model_len=4096)


@pytest.mark.parametrize("dtype, expected", [
    ("auto", torch.bfloat16), ("half", torch.float16), ("float", torch.float32),
    ("float16", torch.float16), (torch.bfloat16, torch.bfloat16), ("float32", torch.float32),
])
def test_dtype(qwen3_dir, dtype, expected):
    assert ModelConfig.from_pretrained(qwen3_dir, dtype=dtype).dtype == expected


@pytest.mark.parametrize("dtype", ["int8", "fp8", torch.int32, 3])
def test_bad_dtype(qwen3_dir, dtype):
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig.from_pretrained(qwen3_dir, dtype=dtype)


def test_torch_dtype_override_is_the_dtype_override(qwen3_dir):
    """transformers 5 renamed torch_dtype to dtype and drops the old key unchecked: the override is read as
    dtype, so a bad value is an error and a good one selects the auto dtype."""
    assert ModelConfig.from_pretrained(qwen3_dir, hf_overrides={"torch_dtype": "float16"}).dtype == torch.float16
    with pytest.raises(ValueError, match="bogus"):
        ModelConfig.from_pretrained(qwen3_dir, hf_overrides={"torch_dtype": "bogus"})
    with pytest.raises(ValueError, match="give one"):
        ModelConfig.from_pretrained(qwen3_dir, hf_overrides={"torch_dtype": "float16", "dtype": "float32"})


def test_auto_dtype_without_config_dtype_is_float32(tmp_path):
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    assert ModelConfig.from_pretrained(tmp_path).dtype == torch.float32


def test_missing_model_folder(tmp_path):
    with pytest.raises((FileNotFoundError, OSError, ValueError)):
        ModelConfig.from_pretrained(tmp_path / "nope")


def _phi3_longrope():
    from transformers import Phi3Config

    half = 16 // 2
    return Phi3Config(**TINY, max_position_embeddings=131072, original_max_position_embeddings=4096,
                      rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * half,
                                       "long_factor": [4.0] * half, "rope_theta": 1e4})


def _config_cases():
    from transformers import Gemma2Config, Gemma3TextConfig, GPT2Config

    return {
        "llama3.1": lambda: LlamaConfig(**TINY, max_position_embeddings=131072, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 5e5}),
        "gemma2": lambda: Gemma2Config(**TINY, head_dim=16, max_position_embeddings=8192),
        "gemma3_text": lambda: Gemma3TextConfig(**TINY, head_dim=16, max_position_embeddings=32768),
        "phi3_longrope": _phi3_longrope,
        "gpt2": lambda: GPT2Config(n_embd=64, n_layer=1, n_head=4, n_positions=1024, vocab_size=128),
    }


@pytest.mark.parametrize("name", list(_config_cases()))
def test_common_architectures_load(tmp_path, name):
    _config_cases()[name]().save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # real configs are consistent: no rope warning
        mc = ModelConfig.from_pretrained(tmp_path)
    assert {"rope_type", "rope_theta"} <= set(mc.rope_parameters)
    expected = {"llama3.1": 131072, "gemma2": 8192, "gemma3_text": 32768, "phi3_longrope": 131072, "gpt2": 1024}
    assert mc.max_model_len == expected[name]


def test_separate_tokenizer_folder_bounds_length(qwen3_dir, tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    mc = ModelConfig.from_pretrained(qwen3_dir, tokenizer=tok)
    assert mc.tokenizer == str(tok) and mc.max_model_len == 1024
    assert mc.model == str(qwen3_dir) and mc.model_path == qwen3_dir


def test_a_model_folder_without_config_json_says_so(tmp_path):
    """fresh user: a folder of scripts gave transformers' "Unrecognized model ... should have a model_type key in its
    config.json", about a config.json that does not exist."""
    from fxrewrite.errors import UserFileNotFoundError

    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch" / "train.py").write_text("")
    with pytest.raises(UserFileNotFoundError, match=r"model '.*scratch' is a folder without a config.json; expected "
                                                    r"a model folder"):
        ModelConfig.from_pretrained(str(tmp_path / "scratch"))


def test_missing_tokenizer_path_names_the_tokenizer(qwen3_dir, tmp_path):
    """fresh-8 F18: the error blamed `model`."""
    from fxrewrite.errors import UserFileNotFoundError

    with pytest.raises(UserFileNotFoundError, match=r"^tokenizer '.*/no-tok' is not an existing folder"):
        ModelConfig.from_pretrained(qwen3_dir, tokenizer=str(tmp_path / "no-tok"))


def test_escape_variable_is_reported_once(qwen3_dir, monkeypatch, caplog):
    import logging

    monkeypatch.setenv("FXREWRITE_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with caplog.at_level(logging.DEBUG), pytest.warns(UserWarning) as record:
        ModelConfig.from_pretrained(qwen3_dir, hf_overrides={**SEED_OVERRIDES, "max_model_len": 131073})
    said = [str(w.message) for w in record if "131073" in str(w.message)]
    said += [r.getMessage() for r in caplog.records if "131073" in r.getMessage()]
    assert len(said) == 1, said


def test_auto_dtype_says_when_the_config_dtype_cannot_compute(caplog):
    """fresh-user report: hf_overrides dtype='int8' fell back to float32 without a word."""
    import logging

    import torch

    from fxrewrite.runtime.model_files.config import resolve_dtype

    class Config:
        dtype = "int8"

        def get_text_config(self):
            return self

    with caplog.at_level(logging.WARNING):
        assert resolve_dtype("auto", Config()) == torch.float32
    assert "the config's dtype 'int8' is not one the model can compute in" in caplog.text
    assert "pass dtype (--dtype) to choose" in caplog.text
