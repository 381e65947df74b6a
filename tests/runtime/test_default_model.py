"""The built-in default model (SmolLM2-135M-Instruct from the installed GGUF) and model resolution."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from fxrewrite.runtime.model_files.default_model import (
    DEFAULT_MODEL,
    default_model_path,
    smollm2_gguf_file,
    smollm2_tokenizer_path,
)
from fxrewrite.runtime.model_files.model_cache import cache_root, read_build_info
from fxrewrite.runtime.model_files.folders import resolve_model_path

pytestmark = pytest.mark.slow  # runs first under xdist (tests/conftest.py)


def test_default_model_is_built_in_the_cache_once(default_model_dir):
    info = read_build_info(default_model_dir)
    assert default_model_dir.parent == cache_root() / "models"
    assert Path(info["source"]) == smollm2_gguf_file().resolve()
    weights = default_model_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    again = default_model_path()  # second use: the same folder, not rebuilt

    assert again == default_model_dir
    assert read_build_info(again)["built_at"] == info["built_at"]
    assert weights.stat().st_mtime_ns == mtime
    assert smollm2_tokenizer_path() == default_model_dir  # tokenizer users reuse the full folder


def test_default_model_folder_is_a_clean_hf_checkpoint(default_model_dir):
    config = json.loads((default_model_dir / "config.json").read_text())
    generation = json.loads((default_model_dir / "generation_config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # the GGUF quantizer is dropped before saving
    assert config["dtype"] == "bfloat16"
    assert config["eos_token_id"] == generation["eos_token_id"] == 2  # <|im_end|>, not <|im_start|>

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert "<|im_start|>" in tok.chat_template
    assert tok.model_max_length == config["max_position_embeddings"] == 8192


def test_default_model_answers_paris(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_default_id_and_its_gguf_resolve_to_the_built_folder(default_model_dir):
    assert resolve_model_path(DEFAULT_MODEL) == default_model_dir
    assert resolve_model_path(None) == default_model_dir
    assert resolve_model_path(smollm2_gguf_file()) == default_model_dir  # same file, same cache key


def test_local_folder_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(tmp_path) == tmp_path
    assert resolve_model_path(str(tmp_path)) == tmp_path
    assert resolve_model_path(tmp_path / "..", what="tokenizer") == tmp_path / ".."  # a tokenizer needs no config
    with pytest.raises(FileNotFoundError, match="is a folder without a config.json"):
        resolve_model_path(tmp_path / "..")


def test_missing_paths_are_errors_naming_them(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model_path(missing)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        resolve_model_path(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="not-a-dir"):
        resolve_model_path("./not-a-dir/at/all")


def test_a_file_that_is_not_gguf_is_a_value_error(tmp_path):
    f = tmp_path / "config.json"
    f.write_text("{}")
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_path(f)


def test_bad_values_name_themselves():
    with pytest.raises(ValueError, match="''"):
        resolve_model_path("")
    with pytest.raises(TypeError, match="42"):
        resolve_model_path(42)


def test_unknown_hub_id_offline_says_where_it_looked():
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path("nobody-xyz/no-such-model")
    msg = str(e.value)
    assert "nobody-xyz/no-such-model" in msg and "not a local folder" in msg and "HF cache" in msg


def test_hub_id_in_the_hf_cache_resolves_to_its_snapshot(tmp_path, monkeypatch):
    # The HF cache layout: models--org--name/{refs/main, snapshots/<commit>/...}.
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--some-org--tiny"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "llama"}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))

    assert resolve_model_path("some-org/tiny") == snapshot


def test_cached_build_runs_once_across_concurrent_callers(tmp_path):
    import threading
    import time

    from fxrewrite.runtime.model_files.model_cache import cached_build

    calls = []

    def build(out):
        calls.append(out)
        time.sleep(0.2)  # long enough for the other threads to find the folder missing
        (out / "config.json").write_text("{}")

    results = []
    threads = [threading.Thread(target=lambda: results.append(cached_build("m", "k", build, root=tmp_path)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and results == [tmp_path / "m-k"] * 3
    assert (tmp_path / "m-k" / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_failed_build_leaves_nothing_behind(tmp_path):
    from fxrewrite.runtime.model_files.model_cache import cached_build

    def build(out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        cached_build("m", "k", build, root=tmp_path)
    assert not (tmp_path / "m-k").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_a_copy_of_the_gguf_elsewhere_reuses_the_conversion(default_model_dir, tmp_path):
    """Another virtual environment installs the same GGUF at another path (and mtime): the cache key is
    the content's, so the converted folder is found, not built again (about 260 MB each time)."""
    import shutil

    from fxrewrite.runtime.model_files.gguf_convert import convert_gguf

    copy = tmp_path / "other-venv" / smollm2_gguf_file().name
    copy.parent.mkdir()
    shutil.copy(smollm2_gguf_file(), copy)  # a new path and a new mtime
    built_at = read_build_info(default_model_dir)["built_at"]
    assert convert_gguf(copy, chat_template="unused: the folder exists") == default_model_dir
    assert read_build_info(default_model_dir)["built_at"] == built_at


def test_file_key_follows_the_content_not_the_path(tmp_path):
    from fxrewrite.runtime.model_files.model_cache import file_key

    data = bytearray(os.urandom(5 << 20))  # 5 MiB: head, sampled middle and tail are distinct parts
    a, b = tmp_path / "a.gguf", tmp_path / "sub" / "a.gguf"
    b.parent.mkdir()
    a.write_bytes(data)
    b.write_bytes(data)
    assert file_key(a, "v1") == file_key(b, "v1") != file_key(b, "v2")
    for offset in (10, (1 << 20) + (3 << 20) * 16 // 32 + 100, len(data) - 10):  # 16th of 32 middle blocks
        changed = bytearray(data)
        changed[offset] ^= 0xFF  # a byte of the head, of a sampled middle block, of the tail
        b.write_bytes(changed)
        assert file_key(b, "v1") != file_key(a, "v1"), offset
    b.write_bytes(data + b"x")
    assert file_key(b, "v1") != file_key(a, "v1")
