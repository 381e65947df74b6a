"""Bad `hf_overrides` values are one clear error naming the key and value (new-user review F6), from
`LLM(hf_overrides=...)` (a ValueError: `UserInputError`) and from `--hf-overrides` on the command line
(one `error:` line, exit status 2). Before, a value of the wrong type was huggingface_hub's
StrictDataclassFieldValidationError, and values that load but make no model (0 layers, heads that do
not divide, a shape the checkpoint does not have) failed deep inside the engine with a traceback."""

import logging

import pytest

from fxrewrite.cli import main
from fxrewrite.errors import UserInputError
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.model_files.config import ModelConfig
from fxrewrite.runtime.model_files.config_checks import check_config_overrides
from tests.ports import free_port


@pytest.mark.parametrize("overrides, expected", [
    ({"num_hidden_layers": "two"}, "hf_overrides num_hidden_layers='two' does not fit .*: expected int"),
    ({"rope_parameters": 5}, "hf_overrides rope_parameters=5 does not fit .*: expected RopeParameters | dict"),
    ({"num_hidden_layers": {"a": 1}}, r"hf_overrides num_hidden_layers=\{'a': 1\} does not fit Qwen3Config"),
    ({"dtype": "foo"}, r"hf_overrides \{'dtype': 'foo'\} do not fit .*no attribute 'foo'"),
    ({"num_hidden_layers": 0}, r"num_hidden_layers=0 must be a positive integer \(hf_overrides changed "
                               r"num_hidden_layers from 2\)"),
    ({"max_position_embeddings": 0}, "max_position_embeddings=0 must be a positive integer"),
    ({"vocab_size": -5}, "vocab_size=-5 must be a positive integer"),
    ({"head_dim": 0}, "head_dim=0 must be a positive integer"),
    ({"num_attention_heads": 3}, r"num_attention_heads=3 is not a multiple of num_key_value_heads=2 "
                                 r"\(hf_overrides changed num_attention_heads from 4\)"),
    ({"num_key_value_heads": 3}, r"num_key_value_heads=3 \(hf_overrides changed num_key_value_heads from 2\)"),
    ({"text_config": {"a": 1}}, "the text config is a dict, not a model config"),
])
def test_bad_override_is_a_user_error_naming_key_and_value(tiny_qwen3_dir, overrides, expected):
    with pytest.raises(UserInputError, match=expected):
        ModelConfig.from_pretrained(tiny_qwen3_dir, hf_overrides=overrides)


def test_head_count_that_does_not_divide_hidden_size(tiny_llama_dir):
    """Llama derives head_dim from hidden_size (64) / num_attention_heads; 3 heads do not divide it."""
    overrides = {"num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": None}
    with pytest.raises(UserInputError, match="hidden_size=64 is not a multiple of num_attention_heads=3"):
        ModelConfig.from_pretrained(tiny_llama_dir, hf_overrides=overrides)


def test_shape_the_checkpoint_lacks_is_refused_before_loading(tiny_qwen3_dir):
    """A new hidden_size (or more layers than saved) cannot load the checkpoint: said before any weight is read,
    not as a weight loader's shape error; with random weights (load_format='dummy') the model is built."""
    with pytest.raises(UserInputError, match=r"hf_overrides changed hidden_size 64 -> 32, .*load_format='dummy'"):
        LLM(str(tiny_qwen3_dir), model_impl="native", hf_overrides={"hidden_size": 32, "head_dim": 8})
    three_layers = {"num_hidden_layers": 3, "layer_types": ["full_attention"] * 3}
    with pytest.raises(UserInputError, match=r"num_hidden_layers 2 -> 3 \(the checkpoint holds 2 layers\)"):
        LLM(str(tiny_qwen3_dir), model_impl="native", hf_overrides=three_layers)
    with pytest.raises(UserInputError, match="num_hidden_layers=3 .* but layer_types names 2 layers"):
        LLM(str(tiny_qwen3_dir), model_impl="native", load_format="dummy", hf_overrides={"num_hidden_layers": 3})
    llm = LLM(str(tiny_qwen3_dir), model_impl="native", load_format="dummy", max_model_len=64,
              hf_overrides={"hidden_size": 32, "head_dim": 8, **three_layers})
    assert llm.llm_engine.model_config.hidden_size == 32 and llm.llm_engine.model_config.num_hidden_layers == 3


def test_unknown_key_is_set_with_a_warning(tiny_qwen3_dir, caplog):
    """transformers stores any key (vLLM passes them on too), so a misspelt one is a warning naming it."""
    with caplog.at_level(logging.WARNING, logger="fxrewrite.runtime.model_files.hf_config"):
        mc = ModelConfig.from_pretrained(tiny_qwen3_dir, hf_overrides={"num_hiden_layers": 1, "max_position_embeddings": 512})
    assert "'num_hiden_layers' are not fields of Qwen3Config" in caplog.text
    assert "max_position_embeddings" not in caplog.text and mc.max_model_len == 512
    assert mc.hf_config.num_hiden_layers == 1  # set, as the warning says (transformers' from_pretrained dropped it)
    matryoshka = ModelConfig.from_pretrained(tiny_qwen3_dir, hf_overrides={"is_matryoshka": True})
    assert matryoshka.hf_config.is_matryoshka is True  # vLLM's documented way to enable Matryoshka dimensions


@pytest.mark.parametrize("value, expected", [
    ('{"num_hidden_layers": "two"}', "hf_overrides num_hidden_layers='two' does not fit"),
    ('{"num_attention_heads": 3}', "num_attention_heads=3 is not a multiple of num_key_value_heads=2"),
    ('{"max_position_embeddings": 0}', "max_position_embeddings=0 must be a positive integer"),
])
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_cli_prints_one_error_line(tiny_qwen3_dir, capsys, monkeypatch, command, value, expected):
    import fxrewrite.runtime.server.api_server as api_server

    def serve_forever(*args, **kwargs):  # a regression must fail the test, not serve forever
        raise AssertionError("the server started")

    monkeypatch.setattr(api_server, "run_server", serve_forever)
    extra = ["--prompt", "hi"] if command == "generate" else ["--port", str(free_port())]
    assert main([command, str(tiny_qwen3_dir), "--hf-overrides", value, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fxrewrite {command}: error: ") and expected in err and "\n" not in err


def test_bench_checks_overrides_before_any_arm(capsys, tmp_path):
    with pytest.raises(UserInputError, match="hf_overrides num_hidden_layers='two' does not fit the config of "
                                             "benchmark 'tiny': expected int"):
        check_config_overrides({"model_type": "qwen3", "num_hidden_layers": 2}, {"num_hidden_layers": "two"},
                               "benchmark 'tiny'")
    argv = ["bench", "compare", "--config", "tiny", "--arms", "native", "--hf-overrides", '{"num_hidden_layers": 0}',
            "--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr()
    assert "fxrewrite bench: error: num_hidden_layers=0 must be a positive integer" in err.err
    assert "[bench]" not in err.out and not list(tmp_path.iterdir())  # no arm ran, no result written


def test_bench_checks_a_quantization_config_override_before_any_arm(capsys, tmp_path):
    """fresh-user report: a malformed quantization_config override failed inside every arm, one error each."""
    bad = '{"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}'
    argv = ["bench", "compare", "--config", "tiny", "--arms", "native", "--hf-overrides", bad, "--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr()
    assert "fxrewrite bench: error: weight_block_size=[128] must be two positive integers, e.g. [128, 128]" in err.err
    assert "[bench]" not in err.out and not list(tmp_path.iterdir())
