"""The training examples under examples/ run end to end on a CPU."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trainer_example_runs(tiny_model_dir, tmp_path):
    out = _load("train_trainer").main(["--model", str(tiny_model_dir("llama")), "--max-steps", "2",
                                       "--output-dir", str(tmp_path)])
    assert out["global_step"] == 2
    assert len(out["losses"]) == 2 and all(math.isfinite(x) for x in out["losses"])


def test_sft_example_runs(tiny_model_dir, tmp_path):
    out = _load("train_sft_trl").main(["--model", str(tiny_model_dir("llama")), "--max-steps", "2",
                                       "--output-dir", str(tmp_path)])
    assert out["global_step"] == 2 and all(math.isfinite(x) for x in out["losses"])


def test_grpo_trl_example_samples_with_the_engine(tiny_model_dir, tmp_path, monkeypatch):
    """TRL's GRPOTrainer(rollout_func=...) takes its rollouts from fxrewrite's engine: every generation call
    goes through the hook, and the engine gets the trainer's weights after each optimizer step."""
    module = _load("grpo_trl")
    syncs, calls = [], []
    make = module.engine_rollout_func

    def counting(llm):
        rollout = make(llm)
        load = llm.load_weights
        monkeypatch.setattr(llm, "load_weights", lambda m: syncs.append(1) or load(m))

        def wrapped(prompts, trainer):
            calls.append(len(prompts))
            return rollout(prompts, trainer)
        return wrapped

    monkeypatch.setattr(module, "engine_rollout_func", counting)
    out = module.main(["--model", str(tiny_model_dir("llama")), "--max-steps", "2", "--num-generations", "2",
                       "--max-completion-length", "4", "--output-dir", str(tmp_path)])
    assert out["global_step"] == 2 and all(math.isfinite(x) for x in out["losses"])
    assert calls == [2, 2] and len(syncs) == 1  # one sync: before the second step's rollouts
