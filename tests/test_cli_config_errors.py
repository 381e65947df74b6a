"""Bad engine configuration from the command line is one line, not a traceback (fourth-session new-user run)."""

from __future__ import annotations

import pytest

from fxrewrite.cli import main


@pytest.mark.parametrize("flags, words", [
    (["-tp", "2"], "must divide the model's num_attention_heads=9"),
    (["--hf-overrides", '{"rope_parameters": {"factor": 2.0}}'], "rope_type"),
    (["-pp", "64"], "is larger than the model's num_hidden_layers"),
])
def test_engine_config_errors_are_one_line(flags, words, capsys):
    assert main(["generate", "--prompt", "hi", "--max-tokens", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
