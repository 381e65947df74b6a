"""Benchmark arguments that used to fail late or wrongly (a new user's run, forty-sixth session): an unusable
`--out` refused before any arm runs, in folder and file entry points alike; `--tokenizer-dir` checked and part
of the cached folder's key; GPU-only tools say so first; ratios from unrounded figures."""

from __future__ import annotations

import argparse

import pytest
import torch

from fxrewrite.benchmarks import count_launches, find_host_syncs, profile_decode, saved_tensors
from fxrewrite.benchmarks.common import bench_model_dir, load_bench_config
from fxrewrite.benchmarks.compare import ratios
from fxrewrite.benchmarks.out_paths import result_file, results_folder
from fxrewrite.cli import main
from fxrewrite.errors import UserFileNotFoundError, UserInputError
from fxrewrite.runtime.model_files.qwen_tokenizer import write_qwen3_tokenizer


def test_out_folder_taken_by_a_file_is_refused_before_the_arms(tmp_path, capsys):
    taken = tmp_path / "f.json"
    taken.write_text("{}")
    for command in (["bench", "train", "--config", "tiny", "--arms", "stock", "--steps", "1"],
                    ["bench", "kernels", "--cpu-smoke"], ["bench", "compare", "--config", "tiny"]):
        with pytest.raises(SystemExit) as e:  # argparse: usage error, status 2, no arm started
            main([*command, "--out", str(taken)])
        assert e.value.code == 2
        assert f"'{taken}' is a file; expected a results folder" in capsys.readouterr().err
    made = results_folder(str(tmp_path / "a" / "b"))
    assert made.is_dir()


def test_out_file_naming_a_folder_is_refused(tmp_path, capsys):
    with pytest.raises(argparse.ArgumentTypeError, match="is a folder; expected the path of the JSON file"):
        result_file(str(tmp_path))
    assert result_file(str(tmp_path / "new" / "x.json")).parent.is_dir()
    for bad in ("", str(tmp_path / "newdir") + "/"):  # a trailing slash means a folder, not a file named newdir
        with pytest.raises(argparse.ArgumentTypeError, match="is a folder"):
            result_file(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="an empty path"):
        results_folder("")
    with pytest.raises(SystemExit):
        saved_tensors.main(["--config", "tiny", "--out", str(tmp_path)])
    assert "is a folder" in capsys.readouterr().err


def test_tokenizer_dir_is_checked_and_keys_the_cached_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("FXREWRITE_CACHE", str(tmp_path / "cache"))
    spec = load_bench_config("tiny")
    for bad in (tmp_path / "missing", tmp_path):  # no folder; a folder without tokenizer files
        with pytest.raises(UserFileNotFoundError, match="no tokenizer files there"):
            bench_model_dir(spec, bad)
    own = tmp_path / "tok"
    write_qwen3_tokenizer(own)  # makes the folder (the BENCHMARKS.md one-liner)
    (own / "model.safetensors").write_bytes(b"not a tokenizer")
    with_own = bench_model_dir(spec, own)
    assert with_own != bench_model_dir(spec) and not (with_own / "model.safetensors").exists()
    (own / "tokenizer_config.json").write_text("{}")
    assert bench_model_dir(spec, own) != with_own  # other tokenizer contents, another folder


def test_gpu_only_tools_say_so_first(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "not-made"
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        find_host_syncs.main(["--config", "tiny", "--out", str(out)])
    assert not out.exists()  # refused before anything was made
    for tool in (profile_decode, find_host_syncs):
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            tool.main(["--config", "tiny", "--arm", "native"] + (["--out", str(tmp_path)] if tool is profile_decode
                                                                  else ["--no-sync-debug"]))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UserInputError, match="set TRITON_INTERPRET=1"):
        count_launches.main(["--out", str(tmp_path)])


@pytest.mark.parametrize("command, arms", [("train", "stock"), ("compare", "native,after")])
def test_bench_on_a_device_torch_lacks_is_one_error(capsys, tmp_path, command, arms):
    """Before any arm runs (compare ran every arm to the same failure and wrote a result file of them: a fresh
    user's find)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    argv = ["bench", command, "--config", "tiny", "--arms", arms, "--device", "cuda", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "device='cuda': this torch sees no CUDA device" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_ratios_use_unrounded_figures():
    arms = {"native": {"output_tokens": 1636, "elapsed_s": 10.0, "output_tokens_per_s": 163.6},
            "hf": {"output_tokens": 28, "elapsed_s": 33.731, "output_tokens_per_s": 0.8},
            "after": {"output_tokens": 1, "elapsed_s": 30.0, "output_tokens_per_s": 0.0}}
    got = ratios({"workload": {"kind": "throughput"}, "arms": arms})
    assert got["native/hf"] == round(163.6 / (28 / 33.731), 3)  # 197.1, not 163.6 / 0.8 = 204.5
    assert got["after/native"] == round((1 / 30) / 163.6, 3) and "after/hf" in got  # a figure shown as 0.0 keeps its ratio


def test_profile_decode_batch_sizes(capsys):
    """--batch takes one size or a comma list (sorted, each once, at most the largest CUDA graph bucket)."""
    assert profile_decode._batch_sizes("256,1,1,64") == [1, 64, 256]
    for bad in ("0", "1,,2", "-1", "", "1.5", "2000"):
        with pytest.raises(SystemExit) as exit_info:
            profile_decode.main(["--config", "tiny", "--batch", bad])
        assert exit_info.value.code == 2
        assert "argument --batch" in capsys.readouterr().err


def test_find_host_syncs_profiles_the_timed_run_on_a_cpu():
    """The function under the CLI's CUDA check runs anywhere: launches timed, cProfile's top functions reported."""
    result = find_host_syncs.find_host_syncs("tiny", "native", num_prompts=3, max_input_len=12, max_output_len=4,
                                             cprofile=5, enforce_eager=True, device="cpu")  # the sync check: CUDA's
    assert result["output_tokens"] > 0 and result["steps"] >= 4
    assert sum(v["steps"] for k, v in result["launch"].items() if k in ("graph", "eager")) >= result["steps"] - 1
    assert len(result["top_functions"]) == 5
    assert all(row["calls"] >= 1 and row["own_s"] >= 0 for row in result["top_functions"])


def test_ratios_compare_only_figures_of_one_kind():
    """With --decode-window the engine arms' headline is the window, the hf arm's the whole run (a fresh user saw
    after/hf = 73.3 from the two): such a pair has no ratio; two window arms keep theirs."""
    window = {"headline_key": "decode_window.output_tokens_per_s", "decode_window": {"output_tokens_per_s": 400.0}}
    arms = {"after": dict(window), "native": dict(window),
            "hf": {"output_tokens": 72, "elapsed_s": 13.1, "output_tokens_per_s": 5.5}}
    got = ratios({"workload": {"kind": "throughput"}, "arms": arms})
    assert got == {"after/native": 1.0}
