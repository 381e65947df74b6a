"""`fxrewrite explain MODEL_DIR` prints the report table and the source diff."""

import sys
from pathlib import Path

import pytest

from fxrewrite.cli import main

from tests.e2e.tiny_models import tiny_model  # noqa: E402


def test_explain_prints_report_and_diff(tmp_path, capsys):
    model = tiny_model("qwen3")
    model.config.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    assert main(["explain", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "module class" in out and "Qwen3Attention" in out
    assert "qkv: q_proj,k_proj,v_proj -> qkv_proj" in out
    assert "+    query_states, key_states = self.qk_norm_rope(" in out
    assert "(fxrewrite)" in out and "source edits" in out
    # one statement per line (the q/k/v split takes the blank line above q, so line numbers stay)
    assert "+    _fx_q, _fx_k, _fx_v = self.qkv_proj(hidden_states).split(self.qkv_proj.output_sizes, dim=-1)\n" in out
    assert "+    query_states = _fx_q.view(hidden_shape)" in out and "dim=-1); " not in out
    assert ("+    # fxrewrite: the residual add, `residual = hidden_states`, the norm and the closing add are in the mlp call "
            "below\n") in out
    assert "+    # fxrewrite: hidden_states = self.input_layernorm(hidden_states) is in the call below\n" in out
    # one fusion per line in the table
    (qkv_line,) = [line for line in out.splitlines() if "qkv: q_proj,k_proj,v_proj -> qkv_proj" in line]
    assert "qk_norm_rope" not in qkv_line and any(line.lstrip().startswith("qk_norm_rope: ") for line in out.splitlines())


def test_rewritten_forwards_keep_their_line_count():
    """Tracebacks through a rewritten forward point at the real file: the qkv and residual-norm edits keep
    every line where it was (the diff hunks have equal lengths on both sides)."""
    import re

    import fxrewrite

    model = tiny_model("llama")
    fxrewrite.optimize(model)
    report = fxrewrite.explain(model)
    for name in ("LlamaAttention", "LlamaDecoderLayer"):
        hunks = re.findall(r"^@@ -\d+,(\d+) \+\d+,(\d+) @@", report.classes[name].diff, re.M)
        assert hunks and all(a == b for a, b in hunks), (name, hunks)


def test_explain_missing_folder_is_clean_error(tmp_path, capsys):
    assert main(["explain", str(tmp_path / "nope")]) == 2
    assert "error" in capsys.readouterr().err


def test_report_table_keeps_columns_aligned_for_long_module_names():
    from fxrewrite.report import FusionReport

    report = FusionReport()
    long = report.entry("Qwen3MoeSparseMoeBlockWithAVeryLongQualifiedNameFromSomeRemoteCodeModule")
    long.instances = 3
    long.applied = {"qkv": {"fused q/k/v projections into one GEMM": 3}}
    long.skip("rms_norm", "not proven")
    short = report.entry("Short")
    short.instances = 12
    lines = str(report).splitlines()
    header = lines[0]
    starts = [header.index(title) for title in ("instances", "applied", "skipped (reason)")]
    for line in lines[2:]:
        assert len(line) <= starts[2] or line[starts[2] - 2 : starts[2]] == "  ", line
        for start in starts:  # every cell starts at its column (or the line is a continuation)
            assert line[start - 2 : start] in ("  ", ""), line
    assert lines[2].split()[1] == "3" and any(line.startswith("Short ") and " 12 " in line for line in lines)
    assert "".join(line[: starts[0]].strip() for line in lines[2:4]) == long.name


def test_explain_defaults_to_the_built_in_model(default_model_dir, capsys):
    """As `generate` and `serve`: no MODEL means the default model (SmolLM2, a Llama)."""
    from fxrewrite.cli import build_parser

    assert build_parser().parse_args(["explain"]).model is None
    help_text = build_parser()._subparsers._group_actions[0].choices["explain"].format_help()
    assert "default: the built-in default model" in " ".join(help_text.split())
    assert main(["explain", "--no-diff"]) == 0
    assert "LlamaAttention" in capsys.readouterr().out


def test_explain_bad_hf_overrides_name_the_value_and_what_was_expected(tmp_path, capsys):
    for value, said in (("not json", "not valid JSON"), ("[1, 2]", "expected a JSON object")):
        with pytest.raises(SystemExit) as exit_info:
            main(["explain", str(tmp_path), "--hf-overrides", value])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and said in err and repr(value) in err, err
