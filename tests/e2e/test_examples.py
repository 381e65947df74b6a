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
