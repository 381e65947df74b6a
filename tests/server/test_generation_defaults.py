"""--generation-config: defaults from generation_config.json, "vllm" for none, or another folder."""

import json

import pytest

from fxrewrite.runtime.server.generation_defaults import load_generation_defaults


def test_generation_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 64, "do_sample": True, "min_p": None}))
    assert load_generation_defaults(tmp_path) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 64}
    assert load_generation_defaults(tmp_path, "vllm") == {}
    assert load_generation_defaults(tmp_path / "missing") == {}
    assert load_generation_defaults("/nowhere", str(tmp_path))["top_k"] == 20
    with pytest.raises(FileNotFoundError, match="generation_config.json"):
        load_generation_defaults(tmp_path, str(tmp_path / "missing"))
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="JSON object"):
        load_generation_defaults(tmp_path)
