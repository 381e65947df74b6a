"""CPU smoke test of `fxrewrite bench rl` with tiny sizes: both arms run, times split, the JSON is written."""

from __future__ import annotations

import json

from fxrewrite.benchmarks.common import load_bench_config


def test_cli_bench_rl_tiny(tmp_path, capsys):
    from fxrewrite.cli import main

    spec = load_bench_config("tiny")
    spec["name"], spec["tokenizer"] = "tiny-smollm2", "smollm2"  # a 49k vocabulary keeps it quick
    spec["config"].update(vocab_size=49152, bos_token_id=1, eos_token_id=2)
    config = tmp_path / "tiny-smollm2.json"
    config.write_text(json.dumps(spec))
    rc = main(["bench", "rl", "--config", str(config), "--num-prompts", "2", "--samples", "2", "--max-tokens", "3",
               "--iterations", "1", "--micro-batch", "3", "--hf-batch", "4", "--sync-configs", str(config),
               "--device", "cpu", "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    saved = json.loads(next((tmp_path / "out").glob("*-rl.json")).read_text())
    engine, hf = saved["arms"]["engine"]["iterations"][0], saved["arms"]["hf"]["iterations"][0]
    assert engine["completion_tokens"] == hf["completion_tokens"] == 2 * 2 * 3
    assert engine["sync_s"] > 0 and hf["sync_s"] < engine["sync_s"]
    for it in (engine, hf):  # the train step's split, and its padding (prompts of unequal lengths)
        assert set(it["train_phases_s"]) == {"forward", "backward", "optimizer"}
        assert all(v > 0 for v in it["train_phases_s"].values()) and it["padded_tokens"] >= it["tokens"] > 12
    assert "train step (last iteration): forward" in captured.out
    assert engine["logprob_abs_diff_max"] < 1e-4  # float32: the engine's logprobs are the trainer's
    sync = saved["weight_sync"]["tiny-smollm2"]
    assert sync["fused_s"]["min"] > 0 and sync["num_fused_tensors"] < sync["num_hf_tensors"]
    assert saved["logprob_agreement"]["abs_diff_mean"] < 1e-5 and not saved["logprob_agreement"]["batch_invariant"]
    wake = saved["arms"]["engine"]["sleep_wake_up"]
    assert wake["sleep_s"] > 0 and wake["wake_up_s"] > 0 and wake["num_graphs"] == 0  # no CUDA graphs on a CPU
    assert "whole iteration" in captured.out and "wake_up" in captured.out
    assert saved["speedup_bound_free_rollouts"] >= saved["speedup_last_iteration"]


def test_micro_batches_by_sequences_and_padded_tokens():
    from fxrewrite.benchmarks.rl import micro_batches

    prompts, completions = [[1] * 4, [1] * 2, [1] * 9, [1], [1] * 3], [[2] * 4] * 5
    assert micro_batches(prompts, completions, 2, None) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    # padded tokens = rows x longest (prompt + completion; 8, 6, 13, 5, 7): 2 x 8, 13 alone (2 x 13 > 20), 2 x 7
    assert micro_batches(prompts, completions, 8, 20) == [slice(0, 2), slice(2, 3), slice(3, 5)]
    assert micro_batches(prompts, completions, 8, 1) == [slice(i, i + 1) for i in range(5)]  # one row always fits


def test_cli_bench_rl_rejects_unknown_arm(capsys):
    from fxrewrite.cli import main

    assert main(["bench", "rl", "--config", "tiny", "--arms", "vllm"]) == 2
    assert "engine, hf" in capsys.readouterr().err


def test_cli_bench_rl_sync_only(tmp_path, capsys):
    """--arms none: only the weight-sync timings (how the GPU script times Qwen3-4B), in their own JSON."""
    from fxrewrite.cli import main

    rc = main(["bench", "rl", "--config", "tiny", "--arms", "none", "--sync-configs", "tiny", "--device", "cpu",
               "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err
    (path,) = tmp_path.glob("*-rl-sync.json")
    saved = json.loads(path.read_text())
    assert saved["arms"] == {} and saved["weight_sync"]["tiny"]["fused_s"]["min"] > 0
    assert "logprob_agreement" not in saved and "speedup_last_iteration" not in saved
    assert main(["bench", "rl", "--config", "tiny", "--arms", "none", "--sync-configs", ""]) == 2


def test_a_step_whose_advantages_are_all_zero_says_so(tiny_qwen3_dir, capsys):
    """Equal rewards in every group give zero advantages and an update of nothing; the iteration says so (a fresh
    user's short completions, always all distinct, scored 1.0 each and trained nothing, silently)."""
    import torch
    from transformers import AutoModelForCausalLM

    from fxrewrite.benchmarks.rl import train_step

    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_dir), dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prompts, completions = [[1, 2, 3]] * 4, [[4, 5], [6, 7], [8, 9], [10, 11]]
    before = [p.detach().clone() for p in model.parameters()]
    flat = train_step(model, optimizer, prompts, completions, None, [1.0, 1.0, 0.5, 0.5], samples=2, micro_batch=4)
    assert "every advantage was 0" in flat["note"] and "warning: every advantage" in capsys.readouterr().out
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    moved = train_step(model, optimizer, prompts, completions, None, [1.0, 0.0, 0.5, 0.5], samples=2, micro_batch=4)
    assert "note" not in moved and any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
