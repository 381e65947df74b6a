"""vLLM's `download_dir` (`--download-dir`): the Hugging Face hub cache folder a hub id is read from (and
downloaded into). Offline here: a hub cache laid out by hand in a tmp folder stands in for a download."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = "fxrewrite-test/tiny-download-dir"  # in no real cache
REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, tiny_qwen3_dir, monkeypatch) -> Path:
    """A download dir holding REPO in huggingface_hub's cache layout (models--org--name/snapshots/<rev>/ and
    refs/main naming <rev>), the tiny Qwen3 folder's files in the snapshot; HF_HUB_OFFLINE=1."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "downloads" / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(tiny_qwen3_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return tmp_path / "downloads"


def test_a_hub_id_is_read_from_the_download_dir(hub_cache):
    from fxrewrite.runtime.model_files.folders import resolve_model_path

    folder = resolve_model_path(REPO, download_dir=hub_cache)
    assert folder == hub_cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / REVISION
    with pytest.raises(FileNotFoundError, match=f"{REPO}.*not in the HF cache \\(HF_HUB_OFFLINE"):
        resolve_model_path(REPO)  # the default cache has no such id: the download dir was what found it
    with pytest.raises(FileNotFoundError, match=f"download_dir '{hub_cache / 'elsewhere'}'"):
        resolve_model_path(REPO, download_dir=hub_cache / "elsewhere")


def test_llm_loads_a_hub_id_from_the_download_dir(hub_cache, tiny_qwen3_dir):
    from fxrewrite import SamplingParams
    from fxrewrite.runtime.llm import LLM

    llm = LLM(model=REPO, download_dir=str(hub_cache), kv_cache_memory_bytes=1 << 22, max_model_len=256)
    assert llm.llm_engine.config.download_dir == str(hub_cache)
    assert str(llm.model_config.model_path).startswith(str(hub_cache)) and llm.model_config.model == REPO
    out = llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    local = LLM(str(tiny_qwen3_dir), download_dir=str(hub_cache / "unused"), kv_cache_memory_bytes=1 << 22,
                max_model_len=256)  # a local folder ignores it
    assert local.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0),
                          use_tqdm=False)[0].outputs[0].token_ids == out[0].outputs[0].token_ids
    assert not (hub_cache / "unused").exists()


def test_download_dir_values():
    from fxrewrite.runtime.engine_config import EngineConfig

    assert EngineConfig(download_dir=Path("~/hub")).download_dir == str(Path("~/hub").expanduser())
    assert EngineConfig().download_dir is None
    for bad in (5, "", ["a"]):
        with pytest.raises(TypeError, match=r"download_dir=.* must be a folder path"):
            EngineConfig(download_dir=bad)


def test_the_flag_reaches_the_engine_and_the_help():
    from fxrewrite.cli import build_parser
    from fxrewrite.commands.engine_args import engine_kwargs

    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["serve", "org/name", "--download-dir", "/d"]))["download_dir"] == "/d"
    assert engine_kwargs(parser.parse_args(["generate", "--prompt", "hi"]))["download_dir"] is None
    for command in ("serve", "generate", "chat"):
        help_text = parser._subparsers._group_actions[0].choices[command].format_help()
        assert "--download-dir DOWNLOAD_DIR" in help_text, command


def test_explain_reads_a_hub_id_from_the_download_dir(hub_cache, capsys):
    """`fxrewrite explain` takes the loading flags of the other commands (it had neither)."""
    from fxrewrite.cli import main

    assert main(["explain", REPO, "--download-dir", str(hub_cache), "--revision", "main", "--no-diff"]) == 0
    assert "qkv" in capsys.readouterr().out
    assert main(["explain", REPO, "--no-diff"]) == 2  # not in the default cache: the download dir was what found it
    assert "not in the HF cache" in capsys.readouterr().err
