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


@pytest.mark.parametrize("flags, expected", [
    (["--max-logprobs", "abc"], "expected a positive integer or -1 (no limit), got 'abc'"),
    (["--max-num-seqs", "many"], "expected a positive integer, got 'many'"),
    (["--kv-cache-memory-bytes", "4Q"], "expected a positive number of bytes (an integer, or one with a size suffix "
                                        "such as 512M or 4G), got '4Q'"),
])
def test_an_integer_flag_that_is_not_a_number_names_what_it_takes(flags, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:  # argparse's own usage error, before any model is read
        main(["generate", "--prompt", "hi", *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and expected in err and "32k" not in err
