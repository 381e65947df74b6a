"""`fxrewrite explain MODEL_DIR` prints the report table and the source diff."""

import sys
from pathlib import Path

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
    assert "(fxrewrite)" in out


def test_explain_missing_folder_is_clean_error(tmp_path, capsys):
    assert main(["explain", str(tmp_path / "nope")]) == 2
    assert "error" in capsys.readouterr().err
