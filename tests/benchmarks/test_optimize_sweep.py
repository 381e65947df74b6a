"""The optimize sweep (`fxrewrite.benchmarks.optimize_sweep`): its verdicts, the dropout switch-off, and one
architecture end to end."""

from __future__ import annotations

import json
import types

import pytest
import torch
from torch import nn

from fxrewrite.benchmarks import optimize_sweep as sweep


def _stages(loss=2.0, grads=None, logits=None, tokens=(5, 6, 7), margins=(1.0, 0.5, 1e-4)):
    grads = grads if grads is not None else {"w": torch.tensor([1.0, -2.0]), "key.bias": torch.tensor([1e-9, 0.0])}
    logits = logits if logits is not None else torch.tensor([[0.5, 1.5]])
    return {"train": (loss, grads), "logits": logits, "generate": (list(tokens), list(margins))}


def test_judge_verdicts():
    model = nn.Linear(2, 2)  # no fused layers: gradient names pass through
    want = _stages()
    assert sweep.judge(model, want, _stages())["status"] == "equal"
    assert sweep.judge(model, want, _stages(loss=2.001))["status"] == "loss_off"
    off = sweep.judge(model, want, _stages(grads={"w": torch.tensor([1.0, -2.1]), "key.bias": torch.zeros(2)}))
    assert off["status"] == "grad_off" and off["worst_grad"] == "w"
    missing = sweep.judge(model, want, _stages(grads={"w": torch.tensor([1.0, -2.0])}))
    assert missing["status"] == "grad_off" and missing["grad_names"]["missing"] == ["key.bias"]
    assert sweep.judge(model, want, _stages(logits=torch.tensor([[0.5, 1.6]])))["status"] == "logits_off"
    wrong = sweep.judge(model, want, _stages(tokens=(5, 9, 7)))
    assert wrong["status"] == "MISMATCH" and wrong["first_diff"] == {"step": 1, "expected": 6, "got": 9, "margin": 0.5}
    assert sweep.judge(model, want, _stages(tokens=(5, 6, 8)))["status"] == "near_tie"
    assert sweep.judge(model, want, _stages(logits=torch.tensor([[float("nan"), 1.5]])))["status"] == "logits_off"


def test_a_gradient_zero_in_exact_arithmetic_is_judged_at_the_model_scale():
    """A key bias's gradient is rounding noise (~1e-9); its relative error alone would be ~1, but measured against the
    model's largest gradient element it is equal."""
    model = nn.Linear(2, 2)
    got = _stages(grads={"w": torch.tensor([1.0, -2.0]), "key.bias": torch.tensor([-3e-9, 1e-9])})
    row = sweep.judge(model, _stages(), got)
    assert row["status"] == "equal" and row["grad_diff"] < 1e-5


def test_deterministic_zeroes_dropout_everywhere():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.3)
            self.attention_dropout = 0.1
            self.config = types.SimpleNamespace(resid_pdrop=0.2, router_jitter_noise=0.5, sub_configs={})

    block = sweep.deterministic(Block())
    assert (block.drop.p, block.attention_dropout) == (0.0, 0.0)
    assert (block.config.resid_pdrop, block.config.router_jitter_noise) == (0.0, 0.0)


def test_batch_pads_the_second_row():
    inputs = sweep.batch(49152)
    assert inputs["attention_mask"][1, -sweep.PAD:].eq(0).all() and inputs["attention_mask"][0].eq(1).all()
    assert inputs["labels"][1, -sweep.PAD:].eq(-100).all() and inputs["labels"][:, :2].eq(-100).all()
    assert sweep.unpadded(inputs)["attention_mask"] is None


def test_one_architecture_end_to_end(capsys):
    """The worker builds a tiny Qwen3, trains one step stock and optimized, and prints one equal row naming the
    patterns applied."""
    assert sweep.main(["--one", "qwen3"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["status"] == "equal" and {"qkv", "glu", "lm_head_loss"} <= set(row["applied"])
    assert row["grad_diff"] < 1e-4 and row["loss_diff"] < 1e-5


def test_float64_arbiter(monkeypatch):
    """A row off by tolerance is `equal_f64` when the optimized logits are no farther from the float64 stock model's
    than ARBITER times the float32 stock model's; a farther one keeps its status."""
    ref = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    monkeypatch.setattr(sweep, "STAGES", {"logits": lambda model, inputs: ref})
    model = nn.Linear(2, 2)
    want = {"logits": torch.tensor([[1.0, 2.0001]])}  # the stock float32 model's own error: 5e-5
    near = sweep.by_float64(model, model, want, {"logits": torch.tensor([[1.0, 1.99992]])}, {"logits": None})
    assert near["status"] == "equal_f64" and near["float64"]["logits"][0] == pytest.approx(5e-5, rel=1e-2)
    far = sweep.by_float64(model, model, want, {"logits": torch.tensor([[1.0, 2.01]])}, {"logits": None})
    assert "status" not in far


def test_device_arguments_are_checked(capsys):
    """--triton is the CPU interpreter: with --device cuda it is an error; --device cuda without a GPU names it."""
    with pytest.raises(SystemExit):
        sweep.main(["--device", "cuda", "--triton", "--archs", "llama"])
    assert "interpreter" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            sweep.main(["--device", "cuda", "--archs", "llama"])
        assert "no CUDA device" in capsys.readouterr().err


def test_workers_get_the_device_and_no_memory_cap_on_cuda(monkeypatch, tmp_path):
    """The sweep passes --device to each worker, and lifts the address-space cap for CUDA workers (a CUDA context
    reserves more address space than the cap)."""
    seen = {}

    def fake_sweep(archs, worker, jobs, timeout, out, memory_cap=True):
        seen.update(worker=worker, memory_cap=memory_cap)
        return __import__("collections").Counter(equal=1)

    monkeypatch.setattr(sweep.arch_sweep, "sweep", fake_sweep)
    monkeypatch.setattr(sweep.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sweep.arch_sweep, "environment", lambda: {})  # it would ask the CUDA device its name
    argv = ["--device", "cuda", "--archs", "llama", "--vocab", "qwen3", "--out", str(tmp_path / "o.jsonl")]
    assert sweep.main(argv) == 0
    assert seen == {"worker": ["fxrewrite.benchmarks.optimize_sweep", "--device", "cuda", "--vocab", "qwen3"],
                    "memory_cap": False}
    summary = json.loads((tmp_path / "o.jsonl").read_text().splitlines()[-1])
    assert summary["device"] == "cuda" and summary["triton_kernels"] is True and summary["vocab"] == "qwen3"
