"""CPU smoke test of the benchmark harness on the `tiny` config: configs, arms, JSON, PNG, CLI errors."""

from __future__ import annotations

import json
import re
import sys

import pytest


from fxrewrite.benchmarks.common import CONFIG_DIR, load_bench_config, parse_arms

# Published parameter counts (embeddings included, tied counted once), to 2 significant digits.
EXPECTED_PARAMS = {"qwen3-0.6b": 0.60e9, "qwen3-4b": 4.0e9, "llama-3.1-8b": 8.0e9, "qwen3-32b": 32.8e9}


def _num_params(cfg: dict) -> float:
    h, i, layers, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    attn = h * d * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])
    per_layer = attn + 3 * h * i
    return layers * per_layer + v * h * (1 if cfg["tie_word_embeddings"] else 2)


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_real_configs_have_the_models_shapes(name):
    spec = load_bench_config(name)
    assert spec["name"] == name
    assert abs(_num_params(spec["config"]) / EXPECTED_PARAMS[name] - 1) < 0.05


def test_every_config_file_loads():
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))
    assert {"qwen3-0.6b", "qwen3-4b", "llama-3.1-8b", "tiny"} <= set(names)
    with pytest.raises(FileNotFoundError, match="nope"):
        load_bench_config("nope")


@pytest.mark.parametrize("edit, message", [
    ({"name": "../../../tmp/escape"}, "name='../../../tmp/escape' must be letters, digits"),
    ({"workload_defaults": {"throughput": {"num_prompts": -4}}}, "num_prompts=-4 must be an integer >= 1"),
    ({"workload_defaults": {"throughput": {"bogus_key": 1}}}, "unknown field 'bogus_key'; expected some of"),
    ({"workload_defaults": {"throughput": {"min_len": 100, "max_input_len": 48}}},
     "min_len=100 must be at most max_input_len=48"),
    ({"workload_defaults": {"latency": {"batch_sizes": []}}}, "batch_sizes=[] must be a non-empty list"),
    ({"workload_defaults": {"throughput": 5}}, "each workload's defaults must be JSON objects"),
    ({"workload_defaults": {"throughputt": {"num_prompts": 4}}}, "workload_defaults: unknown key 'throughputt'"),
    ({"bogus_top": 1}, "unknown key 'bogus_top'; expected some of name, config"),
])
def test_a_bad_bench_config_is_one_user_error_before_any_arm(tmp_path, edit, message):
    """A fresh user's configs: a name that climbed out of the cache folder, a negative prompt count that "succeeded"
    with 0.0 tokens/s, an unknown key (a TypeError traceback), an empty length range (randrange's error)."""

    from fxrewrite.benchmarks.compare import compare
    from fxrewrite.errors import UserInputError

    spec = {**load_bench_config("tiny"), **edit}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(spec))
    kind = next((k for k in edit.get("workload_defaults", {}) if k in ("latency", "long")), "throughput")
    with pytest.raises(UserInputError, match=re.escape(message)):
        compare(str(path), ["after"], kind, out_dir=tmp_path / "out")


def test_parse_arms():
    assert parse_arms("before, after,native,hf") == ["before", "after", "native", "hf"]
    with pytest.raises(ValueError, match="bogus"):
        parse_arms("after,bogus")


def test_throughput_workload_is_nano_vllms():
    from fxrewrite.benchmarks.throughput import ThroughputWorkload

    prompts, outs = ThroughputWorkload().generate()
    assert len(prompts) == 256 and len(outs) == 256
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(100 <= n <= 1024 for n in outs)
    assert ThroughputWorkload().generate() == (prompts, outs)  # seeded


def test_compare_on_tiny_writes_json_and_png(tmp_path):
    import torch

    from fxrewrite.benchmarks.compare import compare, format_table

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = compare("tiny", ["native"], "throughput", num_prompts=2, out_dir=tmp_path,
                         workload_overrides=dict(min_len=4, max_input_len=12, max_output_len=6),
                         engine_kwargs={"max_num_seqs": 4, "kv_cache_memory_bytes": 1 << 22},
                         config_overrides={"num_hidden_layers": 1})
    finally:
        torch.set_num_threads(threads)
    arm = result["arms"]["native"]
    assert "error" not in arm, arm.get("traceback")
    assert arm["output_tokens"] >= 2 * 4 and arm["output_tokens_per_s"] > 0 and not arm["truncated"]
    saved = json.loads((tmp_path / f"{result['name']}.json").read_text())
    assert saved["workload"]["kind"] == "throughput" and saved["environment"]["torch"]
    assert result["name"].endswith("tiny-1layers-throughput") and saved["config_overrides"] == {"num_hidden_layers": 1}
    assert (tmp_path / f"{result['name']}.png").stat().st_size > 0
    assert "native" in format_table(result)


def test_cli_rejects_unknown_arm(capsys):
    from fxrewrite.cli import main

    assert main(["bench", "compare", "--config", "tiny", "--arms", "bogus"]) == 2
    assert "bogus" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["compare", "--config", "tiny", "--time-limit", "0"], "--time-limit"),
    (["compare", "--config", "tiny", "--time-limit", "-1"], "--time-limit"),
    (["compare", "--config", "tiny", "--time-limit", "nan"], "--time-limit"),
    (["train", "--config", "tiny", "--steps", "0"], "--steps"),
    (["train", "--config", "tiny", "--batch-size", "-1"], "--batch-size"),
    (["train", "--config", "tiny", "--warmup", "-1"], "--warmup"),
    (["rl", "--iterations", "0"], "--iterations"),
    (["rl", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["compare", "--config", "tiny", "--time-limit", "inf"], "--time-limit"),
    (["compare", "--config", "tiny", "-pp", "0"], "--pipeline-parallel-size"),
    (["compare", "--config", "tiny", "-tp", "0"], "--tensor-parallel-size"),
    (["compare", "--config", "tiny", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["compare", "--config", "tiny", "--kv-cache-memory-bytes", "-1"], "--kv-cache-memory-bytes"),
    (["compare", "--config", "tiny", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
])
def test_cli_refuses_counts_and_times_that_cannot_run(argv, flag, capsys):
    from fxrewrite.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and (repr(argv[-1]) in err or argv[-1] in err), err


@pytest.mark.parametrize("argv, message", [
    (["train", "--config", "tiny", "--arm-timeout", "nan"], "--arm-timeout: 'nan': expected a finite number"),
    (["train", "--config", "tiny", "--arm-timeout", "60,stock=-1"], "--arm-timeout: 'stock=-1'"),
    (["rl", "--config", "tiny", "--device", "mps"], "device='mps'"),
    (["rl", "--config", "tiny", "--arms", "engine", "--sync-configs", "tiny,abc"], "bench config 'abc' not found"),
    (["train", "--config", "tiny", "--seq-len", "5000"],
     "--seq-len 5000 is longer than tiny's max_position_embeddings 4096"),
])
def test_cli_refuses_before_any_arm_starts(argv, message, capsys):
    from fxrewrite.cli import main

    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_cli_exit_status_is_1_when_every_arm_failed(tmp_path, capsys, monkeypatch):
    """A comparison whose arms all failed still writes its JSON (each arm's error) but exits 1, so a script sees it."""
    import fxrewrite.benchmarks.compare as compare_module
    from fxrewrite.cli import main

    def run_arm(*args, **kwargs):
        raise RuntimeError("the arm cannot start")

    monkeypatch.setattr(compare_module, "run_engine_arm", run_arm)
    rc = main(["bench", "compare", "--config", "tiny", "--arms", "native", "--in-process", "--device", "cpu",
               "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 1 and "every arm failed" in captured.err, captured
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert "the arm cannot start" in saved["arms"]["native"]["error"]


def test_failed_arms_have_no_headline_and_show_in_the_table():
    from fxrewrite.benchmarks.compare import format_table, ratios
    from fxrewrite.benchmarks.plot import arm_failed, headline

    result = {
        "config": "tiny", "date": "d", "environment": {"gpu": "g"}, "workload": {"kind": "throughput"},
        "arms": {"native": {"output_tokens_per_s": 10.0, "output_tokens": 5},
                 "hf": {"output_tokens_per_s": 0.0, "output_tokens": 0, "errors": ["boom"]},
                 "after": {"error": "RuntimeError: x"}},
    }
    assert not arm_failed(result["arms"]["native"]) and arm_failed(result["arms"]["hf"])
    assert headline(result["arms"]["hf"], "throughput") is None
    assert ratios(result) == {}
    table = format_table(result)
    assert "failed: boom" in table and "failed: RuntimeError" in table


def test_cli_latency_with_tensor_parallel_workers(tmp_path, capsys):
    """`bench compare --tensor-parallel-size 2` on the CPU (gloo workers): the latency workload runs and
    its roofline uses one rank's share of the weights (the driver holds none)."""
    from fxrewrite.cli import main

    rc = main(["bench", "compare", "--config", "tiny", "--arms", "native", "--workload", "latency",
               "--tensor-parallel-size", "2", "--max-num-seqs", "8", "--kv-cache-memory-bytes", "4M",
               "--device", "cpu", "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    arm = saved["arms"]["native"]
    assert "error" not in arm, arm.get("traceback")
    assert saved["engine_kwargs"]["tensor_parallel_size"] == 2
    assert arm["batch_1"]["decode_ms_per_step"] > 0 and arm["weight_bytes"] > 0
    import gc

    import torch.distributed as dist

    gc.collect()  # the engine is gone: its workers and process group with it (the next engine can start)
    assert not dist.is_initialized()


def test_cli_moe_data_parallel_expert_parallel_arms(tmp_path, capsys):
    """`bench compare -dp 2 --enable-expert-parallel` on the CPU (4 gloo workers over the two arms, run in
    the harness's process); the before arm of an MoE config runs transformers' eager experts loop and
    says so in the JSON."""
    from fxrewrite.cli import main

    spec = load_bench_config("tiny")
    spec["name"] = "tiny-moe"
    spec["config"].update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    spec["workload_defaults"]["throughput"].update(num_prompts=4, max_output_len=10)
    config = tmp_path / "tiny-moe.json"
    config.write_text(json.dumps(spec))
    rc = main(["bench", "compare", "--config", str(config), "--arms", "before,after", "--data-parallel-size", "2",
               "--enable-expert-parallel", "--kv-cache-memory-bytes", "4M", "--device", "cpu", "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err
    saved = json.loads(next(tmp_path.glob("*-dp2-ep.json")).read_text())
    assert saved["engine_kwargs"]["data_parallel_size"] == 2
    before, after = saved["arms"]["before"], saved["arms"]["after"]
    # The unfused transformers model shares its experts modules across the replicas too (fxrewrite.sharding_moe).
    assert "error" not in before, before.get("traceback")
    assert before["experts_implementation"] == "eager" and before["output_tokens_per_s"] > 0
    assert "error" not in after, after.get("traceback")
    assert after["experts_implementation"] == "fxrewrite FusedMoE" and after["output_tokens_per_s"] > 0


def test_before_arm_of_an_moe_config_runs_the_eager_experts_loop(tmp_path):
    from fxrewrite.benchmarks.common import bench_model_dir, experts_implementation, make_llm

    spec = load_bench_config("tiny")
    spec["name"] = "tiny-moe"
    spec["config"].update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    llm = make_llm("before", bench_model_dir(spec), device="cpu", kv_cache_memory_bytes=1 << 22)
    assert experts_implementation(llm) == "eager"
    assert llm.llm_engine.model_runner.model.hf_model.config._experts_implementation == "eager"
    dense = make_llm("before", bench_model_dir(load_bench_config("tiny")), device="cpu", kv_cache_memory_bytes=1 << 22)
    assert experts_implementation(dense) is None


def test_train_shape_comes_from_the_flags_then_the_config_then_the_gpu_default(monkeypatch):
    """fresh-user report: `bench train --config tiny` ran 8 x 2048 tokens a step on a CPU (minutes per arm)."""
    import fxrewrite.benchmarks.train as train_module
    from fxrewrite.cli import main

    seen = []

    def fake_run(config, arms, **kwargs):
        seen.append((kwargs["batch_size"], kwargs["seq_len"]))
        return {"arms": {"stock": {"tokens_per_s": 1.0}}, "files": []}

    monkeypatch.setattr(train_module, "run_train_bench", fake_run)
    monkeypatch.setattr(train_module, "format_train_table", lambda result: "")
    main(["bench", "train", "--config", "tiny", "--arms", "stock"])
    main(["bench", "train", "--config", "tiny", "--arms", "stock", "--seq-len", "128"])
    main(["bench", "train", "--config", "qwen3-0.6b", "--arms", "stock"])
    assert seen == [(2, 64), (2, 128), (8, 2048)]
