"""Every bench entry point runs end to end on the CPU at tiny sizes, through the CLI (issue 14 item 4,
issue 15 item 9): `bench kernels --cpu-smoke` (a renamed kernel helper breaks it here, not on the GPU),
`bench compare` throughput (each arm in its own process, the tiny config small by default), latency with
`--max-num-seqs 1`, long; a failing arm is recorded and the next arm still runs."""

from __future__ import annotations

import json

import pytest
import torch

import fxrewrite.benchmarks.kernels as kernel_bench
from fxrewrite.cli import main
from tests.triton_cpu import require_interpreter

_KERNEL_GLOBALS = ("BF16", "TOKENS", "HIDDEN", "INTERMEDIATE", "NUM_HEADS", "NUM_KV_HEADS", "HEAD_DIM", "DECODE_CASES",
                   "PREFILL_CASES", "SDPA_LEN", "DEVICE", "DECODE_CONFIGS", "PREFILL_CONFIGS", "MIN_SPLIT_TOKENS",
                   "BLOCK_SIZE", "VOCAB", "SAMPLER_ROWS")


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _saved(tmp_path) -> dict:
    (path,) = tmp_path.glob("*.json")
    return json.loads(path.read_text())


def test_bench_kernels_cpu_smoke(tmp_path, monkeypatch, capsys):
    require_interpreter()
    for name in _KERNEL_GLOBALS:  # the smoke run rebinds the module's sizes: put them back afterwards
        monkeypatch.setattr(kernel_bench, name, getattr(kernel_bench, name))
    assert main(["bench", "kernels", "--cpu-smoke", "--out", str(tmp_path)]) == 0, capsys.readouterr().err
    result = _saved(tmp_path)
    names = [row["name"] for row in result["kernels"]]
    assert {"rms_norm", "silu_and_mul", "reshape_and_cache", "greedy_sample"} <= set(names)
    decode = next(r for r in result["kernels"] if r["name"].startswith("paged_decode"))
    assert decode["rel_err"] < 1e-3 and "num_splits" in json.dumps(result["sweeps"])  # the split sweep ran
    assert "paged_decode" in capsys.readouterr().out


def test_bench_kernels_only_some_groups(tmp_path, monkeypatch, capsys):
    require_interpreter()
    for name in _KERNEL_GLOBALS:
        monkeypatch.setattr(kernel_bench, name, getattr(kernel_bench, name))
    assert main(["bench", "kernels", "--cpu-smoke", "--only", "sampler, sampler", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    assert path.name.endswith("-kernels-sampler-cpu-smoke.json")  # not the name of a full run's file
    rows = json.loads(path.read_text())["kernels"]
    assert [row["name"] for row in rows] == ["greedy_sample"] * 2  # the group once: its two shapes
    assert "greedy_sample [1," in capsys.readouterr().out  # the table tells the shapes apart
    assert main(["bench", "kernels", "--cpu-smoke", "--only", "sampler,sorting", "--out", str(tmp_path)]) == 2
    assert "kernel groups ['sorting'] do not exist" in capsys.readouterr().err
    assert main(["bench", "kernels", "--cpu-smoke", "--only", ",", "--out", str(tmp_path)]) == 2
    assert "no kernel group given" in capsys.readouterr().err  # not "kernel groups [''] do not exist"


def test_bench_kernels_without_a_gpu_is_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["bench", "kernels"]) == 2
    assert "--cpu-smoke" in capsys.readouterr().err


def test_compare_latency_with_one_sequence(tmp_path, capsys, one_thread):
    rc = main(["bench", "compare", "--config", "tiny", "--arms", "native", "--workload", "latency", "--max-num-seqs", "1",
               "--kv-cache-memory-bytes", "4M", "--device", "cpu", "--in-process", "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err
    arm = _saved(tmp_path)["arms"]["native"]
    assert "error" not in arm, arm.get("traceback")
    assert arm["batch_1"]["decode_ms_per_step"] > 0
    # the spread of the step times and the collector's pauses, which tell a stall from per-step overhead
    assert arm["batch_1"]["step_ms_max"] >= arm["batch_1"]["step_ms_median"] > 0
    assert set(arm["batch_1"]["gc_in_timed_run"]) == {"collections", "pause_ms", "max_pause_ms"}
    assert "max_num_seqs=1" in arm["batch_4"]["skipped"]


def test_compare_long_tiny(tmp_path, capsys, one_thread):
    rc = main(["bench", "compare", "--config", "tiny", "--arms", "native", "--workload", "long",
               "--kv-cache-memory-bytes", "8M", "--device", "cpu", "--in-process", "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err
    arm = _saved(tmp_path)["arms"]["native"]
    assert "error" not in arm, arm.get("traceback")
    assert set(arm) >= {"prompt_512", "prompt_1024"} and arm["truncated"] is False
    assert arm["prompt_1024"]["all_logprobs_finite"] is True and arm["prompt_1024"]["decode_tokens_per_s"] > 0


def test_compare_tiny_defaults_and_a_failing_arm_in_own_processes(tmp_path, capsys, one_thread):
    """`compare` as `bench compare --config tiny` calls it: the tiny config's small throughput workload by
    default; each arm in its own process. The first arm raises there (an arm name the harness does not
    know): its error and traceback are recorded, and the next arm, in a fresh process, runs normally."""
    from fxrewrite.benchmarks.compare import compare, format_table

    result = compare("tiny", ["bogus", "native"], "throughput", out_dir=tmp_path,
                     engine_kwargs={"kv_cache_memory_bytes": 1 << 22})
    assert result["workload"]["num_prompts"] == 8 and result["workload"]["max_output_len"] == 16
    assert "KeyError" in result["arms"]["bogus"]["error"] and "traceback" in result["arms"]["bogus"]
    native = result["arms"]["native"]
    assert "error" not in native, native.get("traceback")
    assert native["num_finished"] == 8 and native["output_tokens_per_s"] > 0
    env = result["environment"]
    assert env["gpu"] or "cores" in env["cpu"]
    table = format_table(result)
    assert "none (CPU)" not in table and (env["gpu"] or env["cpu"]) in table
    assert "arm native (2/2)" in capsys.readouterr().out


def test_compare_with_only_a_skipped_arm_shows_why_and_exits_1(tmp_path, capsys):
    """The hf arm on the latency workload is skipped: the table's notes column says why (as the JSON does), and
    with no arm producing a figure the command exits 1 with one error line (the JSON is still written)."""
    rc = main(["bench", "compare", "--config", "tiny", "--arms", "hf", "--workload", "latency", "--max-num-seqs", "1",
               "--device", "cpu", "--in-process", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 1, captured
    reason = "the hf arm runs the throughput workload only"
    assert _saved(tmp_path)["arms"]["hf"] == {"skipped": reason}
    (row,) = [line for line in captured.out.splitlines() if line.startswith("hf ")]
    assert row.split()[:2] == ["hf", "-"] and row.endswith("skipped: " + reason), row
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no arm produced a figure" in errors[0] and "every arm was skipped" in errors[0], \
        captured.err


@pytest.mark.parametrize("arms, rc, message", [
    ("before,hf", 1, "no arm produced a figure (1 skipped, 1 failed"),  # nothing measured: a script must see it
    ("before,native", 0, None),  # one arm failed, another measured: exit 0 as before, the error in the table
    ("native,hf", 0, None),  # one arm skipped, another measured
    ("before", 1, "every arm failed"),
])
def test_compare_exit_status_follows_the_figures(arms, rc, message, tmp_path, capsys, monkeypatch):
    """Exit 1 exactly when no arm produced a headline figure (engine arms faked: the before arm raises, the
    native arm measures; the hf arm is skipped on the latency workload)."""
    import fxrewrite.benchmarks.compare as compare_module

    def run_engine_arm(arm, *args, **kwargs):
        if arm == "before":
            raise RuntimeError("the arm cannot start")
        return {"batch_1": {"decode_tokens_per_s": 12.5}}

    monkeypatch.setattr(compare_module, "run_engine_arm", run_engine_arm)
    got = main(["bench", "compare", "--config", "tiny", "--arms", arms, "--workload", "latency", "--device", "cpu",
                "--in-process", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert got == rc, captured
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    if message is None:
        assert errors == [], captured.err
    else:
        assert len(errors) == 1 and message in errors[0], captured.err
    table = captured.out
    if "before" in arms:
        assert "failed: RuntimeError: the arm cannot start" in table
    if "hf" in arms:
        assert "skipped: the hf arm runs the throughput workload only" in table
    if "native" in arms:
        assert "12.5" in table


@pytest.mark.parametrize("count", ["0", "-3"])
def test_compare_rejects_a_request_count_below_one(count, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "compare", "--config", "tiny", "--num-prompts", count])
    assert exc.value.code == 2
    assert "expected a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("tool", ["train_memory", "optimize_time"])
def test_python_m_tools_report_a_bad_config_in_one_line(tool):
    import subprocess
    import sys

    args = [sys.executable, "-m", f"fxrewrite.benchmarks.{tool}", "--config", "bogus"]
    done = subprocess.run(args + (["--arm", "optimize"] if tool == "train_memory" else []), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if "Warning" not in line and not line.startswith(" ")]
    assert len(lines) == 1 and lines[0].startswith(f"python -m fxrewrite.benchmarks.{tool}: error: bench config "
                                                   "'bogus' not found (see "), done.stderr


def test_host_step_smoke(tmp_path):
    from fxrewrite.benchmarks import host_step

    assert host_step.main(["--out", str(tmp_path), "--num-seqs", "8", "--steps", "5", "--warmup", "2",
                           "--repeats", "1", "--workloads", "final_only,stream,cumulative"]) == 0
    result = _saved(tmp_path)
    for workload in ("final_only", "stream", "cumulative"):
        ms = result["results"][workload]["ms_per_step"]
        assert ms["step"] >= ms["schedule"] > 0 and ms["launch"] >= ms["prepare_inputs"] > 0, ms


@pytest.mark.parametrize("flag", ["--steps", "--repeats", "--num-seqs", "--prompt-len", "--warmup"])
def test_host_step_refuses_a_count_below_one(flag, tmp_path, capsys):
    from fxrewrite.benchmarks import host_step

    with pytest.raises(SystemExit) as exit_info:
        host_step.main(["--out", str(tmp_path), flag, "0"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"argument {flag}: expected a positive integer, got '0'" in err


def test_a_second_compare_the_same_day_does_not_overwrite_the_first(tmp_path, capsys, monkeypatch):
    """fresh-user report: a native-only run replaced the morning's four-arm result of the same name, silently."""
    import fxrewrite.benchmarks.compare as compare_module

    monkeypatch.setattr(compare_module, "run_engine_arm",
                        lambda arm, *args, **kwargs: {"batch_1": {"decode_tokens_per_s": 12.5}})
    for arms in ("native,after", "native"):
        assert main(["bench", "compare", "--config", "tiny", "--arms", arms, "--workload", "latency", "--device", "cpu",
                     "--in-process", "--out", str(tmp_path)]) == 0
    second, first = sorted(tmp_path.glob("*.json"), key=lambda p: p.stem)[::-1]
    assert second.name == first.name.replace(".json", "-2.json"), (first, second)
    assert list(json.loads(first.read_text())["arms"]) == ["native", "after"]
    assert json.loads(second.read_text())["name"] == second.stem
    assert f"exists: this run writes {second.name}" in capsys.readouterr().out


@pytest.mark.parametrize("dtype, expected", [("auto", torch.bfloat16), ("float32", torch.float32)])
def test_the_hf_arm_runs_in_the_dtype_the_engine_arms_resolve(tmp_path, dtype, expected):
    """It was bf16 on CUDA and float32 elsewhere whatever the config or --dtype said: not the engine arms' model."""
    from transformers import Qwen3Config

    from fxrewrite.benchmarks.hf_arm import build_hf_model

    Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, dtype="bfloat16").save_pretrained(tmp_path)
    assert build_hf_model(tmp_path, "cpu", dtype).dtype == expected
