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


@pytest.mark.parametrize("content, message", [
    (json.dumps({"temperature": -1}), "temperature=-1"),
    (json.dumps({"temperature": "hot"}), "temperature"),
    ('{"top_p": NaN}', "top_p"),
    (json.dumps({"max_new_tokens": -3}), "max_new_tokens=-3"),  # the file's key, not SamplingParams' field
])
def test_values_sampling_refuses_are_an_error_at_load(tmp_path, content, message):
    """A default every request would inherit is refused when the file is read (serve would otherwise start and
    answer each request without its own value with a 400 blaming the client)."""
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=rf"generation_config.json: .*{message}"):
        load_generation_defaults(tmp_path)


def test_a_file_that_is_not_utf8_is_an_error(tmp_path):
    (tmp_path / "generation_config.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not valid JSON text"):
        load_generation_defaults(tmp_path, str(tmp_path))
