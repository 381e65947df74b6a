"""What a fresh user reproducing BENCHMARKS.md on a CPU machine ran into: options accepted and ignored or leading to
a run with no figure and no word why, an empty arm list that "succeeded", result JSONs without the date, versions
and commit, and GPU-only tools that died with torch's "not compiled with CUDA" traceback."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

import fxrewrite.benchmarks.kernels as kernel_bench
from fxrewrite.benchmarks.compare import _check_window_fits, format_table, make_workload
from fxrewrite.cli import main
from fxrewrite.errors import UserInputError
from tests.benchmarks.test_bench_entry_points import _KERNEL_GLOBALS
from tests.triton_cpu import require_interpreter


@pytest.mark.parametrize("workload", ["latency", "long"])
def test_num_prompts_is_refused_outside_the_throughput_workload(workload, tmp_path, capsys):
    """It was ignored: a latency run with --num-prompts 4 ran its own batch sizes and exited 0."""
    rc = main(["bench", "compare", "--config", "tiny", "--arms", "native", "--workload", workload,
               "--num-prompts", "4", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and f"--num-prompts applies to the throughput workload, not --workload {workload}" in err
    assert not list(tmp_path.iterdir())  # refused before anything ran or was written


def test_a_decode_window_no_engine_arm_can_reach_is_refused(tmp_path, capsys):
    """--max-num-seqs 2 with 4 requests never runs them all at once: the arm ran and reported '-' with no note."""
    rc = main(["bench", "compare", "--config", "tiny", "--arms", "native", "--num-prompts", "4", "--decode-window",
               "3", "--max-num-seqs", "2", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "all 4 requests running" in err and "--max-num-seqs 2 runs at most 2" in err, err
    workload = make_workload("throughput", 4, overrides={"decode_window_steps": 3})
    _check_window_fits(workload, ["hf"], {"max_num_seqs": 2})  # the hf arm has no window and ignores the flag
    _check_window_fits(workload, ["native"], {"max_num_seqs": 2, "data_parallel_size": 2})  # 2 x 2 replicas fit
    with pytest.raises(UserInputError, match=r"x 2 replicas runs at most 2 at once; expected --max-num-seqs of at least 2"):
        _check_window_fits(workload, ["native"], {"max_num_seqs": 1, "data_parallel_size": 2})
    _check_window_fits(make_workload("throughput", 4), ["native"], {"max_num_seqs": 2})  # no window asked for


def test_the_table_says_why_an_arm_has_no_decode_window_figure():
    reason = "no step decoded every request: the run ended with some still in prefill"
    arm = {"headline_key": "decode_window.output_tokens_per_s", "output_tokens": 44, "elapsed_s": 0.2,
           "decode_window": {"steps": 0, "batch": 0, "output_tokens_per_s": None, "reason": reason}}
    result = {"config": "tiny", "date": "2026-12-07", "environment": {"gpu": None, "cpu": "x"},
              "workload": {"kind": "throughput"}, "arms": {"native": arm, "cut": {**arm, "truncated": True}}}
    lines = format_table(result).splitlines()
    assert lines[2].endswith("no decode window: " + reason), lines
    assert lines[3].endswith("truncated, no decode window: " + reason), lines


@pytest.mark.parametrize("arms", ["", ", ,"])
def test_bench_train_refuses_an_empty_arm_list(arms, tmp_path, capsys):
    """It wrote a JSON and PNG of no arm and exited 0."""
    rc = main(["bench", "train", "--config", "tiny", "--arms", arms, "--out", str(tmp_path)])
    assert rc == 2 and "no train arm given; expected some of ['stock'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def _has_environment(env: dict) -> None:
    assert env["date"] and env["torch"] == torch.__version__ and "transformers" in env and "triton" in env
    assert env["fxrewrite"]["commit"] and "dirty" in env["fxrewrite"]


def test_saved_tensors_and_write_result_record_the_environment(tmp_path, capsys):
    from fxrewrite.benchmarks import saved_tensors
    from fxrewrite.benchmarks.common import write_result

    out = tmp_path / "saved.json"
    assert saved_tensors.main(["--arm", "stock", "--config", "tiny", "--layers", "1", "--batch-size", "1",
                               "--seq-len", "8", "--device", "cpu", "--dtype", "float32", "--out", str(out)]) == 0
    _has_environment(json.loads(out.read_text())["environment"])
    write_result(tmp_path / "plain.json", {"figure": 1.0})  # train_memory's and train_ops' results
    _has_environment(json.loads((tmp_path / "plain.json").read_text())["environment"])
    write_result(tmp_path / "own.json", {"environment": {"mine": True}})  # a tool's own is kept
    assert json.loads((tmp_path / "own.json").read_text())["environment"] == {"mine": True}


def test_bench_kernels_records_the_commit(tmp_path, monkeypatch, capsys):
    require_interpreter()
    for name in _KERNEL_GLOBALS:  # the smoke run rebinds the module's sizes: put them back afterwards
        monkeypatch.setattr(kernel_bench, name, getattr(kernel_bench, name))
    assert main(["bench", "kernels", "--cpu-smoke", "--only", "sampler", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    meta = json.loads(path.read_text())["meta"]
    assert meta["fxrewrite"]["commit"] and meta["cpu"] and meta["transformers"] and meta["triton"]


_GPU_TOOLS = {"kv_cache_fp8": ([],), "gemv_pipelined": ([],), "fp8_gemv_mma": ([],), "decode_prefetch": ([],),
              "fp8_gemm": (), "torch_func_check": ()}


@pytest.mark.parametrize("tool", sorted(_GPU_TOOLS))
def test_gpu_only_tools_say_they_need_a_gpu(tool, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    module = importlib.import_module(f"fxrewrite.benchmarks.{tool}")
    args = _GPU_TOOLS[tool]
    if args:  # a folder for --out (the default is benchmarks/results: nothing may be written there)
        args = (["--out", str(tmp_path)],)
    with pytest.raises(SystemExit) as exc:
        module.main(*args)
    assert str(exc.value).startswith(f"python -m fxrewrite.benchmarks.{tool} needs a CUDA GPU"), exc.value
    assert not list(tmp_path.iterdir())


def test_gpu_check_summary_prints_only_this_runs_comparisons(tmp_path):
    """gpu_check.sh without $OUT summarises benchmarks/results, which also holds train / RL JSONs (whose "arms" are
    no comparison's: a KeyError ended the script) and every earlier run's results."""
    import os

    from fxrewrite.benchmarks.compare import format_tables

    arm = {"output_tokens": 10, "elapsed_s": 1.0, "output_tokens_per_s": 10.0}
    comparison = {"config": "tiny", "date": "d", "environment": {"gpu": "G"}, "workload": {"kind": "throughput"}}
    (tmp_path / "old.json").write_text(json.dumps({**comparison, "arms": {"old": arm}}))
    os.utime(tmp_path / "old.json", (1000, 1000))
    (tmp_path / "new.json").write_text(json.dumps({**comparison, "arms": {"new": arm}}))
    (tmp_path / "train.json").write_text(json.dumps({"kind": "train", "arms": [{"arm": "stock"}]}))
    (tmp_path / "rl.json").write_text(json.dumps({"config": "tiny", "arms": {"engine": {}}}))
    text = format_tables(tmp_path, since=2000)
    assert "new " in text and "old " not in text and text.count("tiny throughput") == 1
    assert "old " in format_tables(tmp_path)


def test_a_latency_run_cut_before_any_decode_step_reports_no_figure():
    """--time-limit 0.01 on the tiny config: the abort right after the first token counted as one decode step of
    ~0.1 ms, a batch-1 figure of 10,324.8 tokens/s (the CPU decodes ~250) with no note in the table."""
    from fxrewrite.benchmarks.common import RunStats
    from fxrewrite.benchmarks.latency import _timed_row

    cut = RunStats(elapsed_s=0.0101, truncated=True, first_token_s={"0": 0.01}, step_end_s=[0.01])
    row, decode_s = _timed_row(cut, 1, 16, 0.01)
    assert decode_s is None and row["truncated"] and row["ttft_ms"] == 10.0
    assert row["error"] == "no decode step after the first token within the time limit (0.01 s)"
    two = RunStats(elapsed_s=0.031, truncated=True, first_token_s={"0": 0.01}, step_end_s=[0.01, 0.02, 0.03])
    row, decode_s = _timed_row(two, 1, 16, 0.01)  # two decode steps before the cut: a figure, marked truncated
    assert decode_s == pytest.approx(0.0105) and row["truncated"] and "error" not in row
    result = {"config": "tiny", "date": "d", "environment": {"gpu": "G"}, "workload": {"kind": "latency"},
              "arms": {"native": {"batch_1": _timed_row(cut, 1, 16, 0.01)[0]}}}
    assert format_table(result).splitlines()[2].endswith("batch_1: no decode step after the first token within the "
                                                         "time limit (0.01 s)")


def test_a_long_run_cut_by_the_time_limit_reports_what_it_ran():
    """--workload long with a time limit: a cut prompt's decode rate was (output_len - 1) tokens over the time it ran,
    all_logprobs_finite false (no final output to read: it read as NaN logprobs), and the table had no note."""
    from fxrewrite.benchmarks.common import RunStats
    from fxrewrite.benchmarks.long import _prompt_row

    cut = RunStats(elapsed_s=2.0, output_tokens=5, truncated=True, first_token_s={"bench-0": 1.0})
    row = _prompt_row(cut, [], 64, 32, 2.0)
    assert row == {"ttft_s": 1.0, "prefill_tokens_per_s": 64.0, "decode_tokens_per_s": 4.0,
                   "all_logprobs_finite": None, "truncated": True}
    early = _prompt_row(RunStats(elapsed_s=2.0, truncated=True), [], 64, 32, 2.0)
    assert early["ttft_s"] is early["decode_tokens_per_s"] is early["all_logprobs_finite"] is None
    assert early["error"] == "no output token within the time limit (2.0 s)"
    arm = {"prompt_32": row, "prompt_64": early, "truncated": True, "decode_tokens_per_s": None}
    result = {"config": "tiny", "date": "d", "environment": {"gpu": "G"}, "workload": {"kind": "long"},
              "arms": {"native": arm}}
    assert format_table(result).splitlines()[2].endswith(
        "truncated, prompt_64: no output token within the time limit (2.0 s)")


def test_hf_num_prompts_is_refused_without_the_hf_arm(tmp_path, capsys):
    """It was accepted and did nothing (gpu_check.sh passed it whatever its ARMS)."""
    rc = main(["bench", "compare", "--config", "tiny", "--arms", "native,after", "--hf-num-prompts", "4",
               "--out", str(tmp_path)])
    assert rc == 2 and "--hf-num-prompts applies to the hf arm, which --arms 'native,after' does not include" in \
        capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_hf_num_prompts_is_refused_for_a_workload_the_hf_arm_skips(tmp_path, capsys):
    """--workload latency / long with the hf arm: the arm is skipped and --hf-num-prompts was accepted, doing nothing."""
    rc = main(["bench", "compare", "--config", "tiny", "--workload", "latency", "--arms", "native,hf",
               "--hf-num-prompts", "4", "--out", str(tmp_path)])
    assert rc == 2 and "--hf-num-prompts applies to the throughput workload, not --workload latency" in \
        capsys.readouterr().err
    assert not list(tmp_path.iterdir())
