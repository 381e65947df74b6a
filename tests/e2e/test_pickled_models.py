"""An optimized model pickled (``torch.save(model)``, a spawned process) or deep-copied is the same model: its
rewritten forwards are compiled again from their recipes and bound to the copy, its hooks and registrations come
along (the ``fxrewrite_sdpa`` attention its config names is registered in the loading process)."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from tests.e2e.tiny_models import tiny_model

import fxrewrite
from fxrewrite.signature import BOUND_ATTR
from fxrewrite.weights import to_hf_names


def _loss_and_grads(model, ids):
    model.train()
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = to_hf_names(model, {name: p.grad for name, p in model.named_parameters()})
    return out.loss.detach(), grads


def _eval_logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _bound_modules(model):
    return [(name, m) for name, m in model.named_modules() if BOUND_ATTR in m.__dict__]


def test_torch_save_then_load_in_a_fresh_process(tmp_path):
    fused = fxrewrite.optimize(tiny_model("qwen3"))
    assert fused.config._attn_implementation == "fxrewrite_sdpa"
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    torch.save(fused, tmp_path / "model.pt")
    torch.save(ids, tmp_path / "ids.pt")
    script = textwrap.dedent(f"""
        import torch
        from tests.e2e.test_pickled_models import _eval_logits, _loss_and_grads
        model = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
        ids = torch.load({str(tmp_path / "ids.pt")!r})
        torch.save((_eval_logits(model, ids), *_loss_and_grads(model, ids), list(model.state_dict())),
                   {str(tmp_path / "out.pt")!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=str(_repo_root()))
    logits, loss, grads, keys = torch.load(tmp_path / "out.pt")
    want_loss, want_grads = _loss_and_grads(fused, ids)
    torch.testing.assert_close(logits, _eval_logits(fused, ids), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert keys == list(fused.state_dict())  # Hugging Face names, stock order
    assert set(grads) == set(want_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("make_copy", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))],
                         ids=["deepcopy", "pickle"])
@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_copies_run_their_own_forwards_like_the_original(arch, make_copy):
    fused = fxrewrite.optimize(tiny_model(arch))
    other = make_copy(fused)
    bound = _bound_modules(other)
    assert [name for name, _ in bound] == [name for name, _ in _bound_modules(fused)] and bound
    for name, module in bound:
        assert module.forward.__self__ is module, name
        assert module.__reduce_ex__.__self__ is module, name
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_eval_logits(other, ids), _eval_logits(fused, ids), rtol=0, atol=0)
    with torch.no_grad():
        next(other.parameters()).add_(1.0)  # the copy's own weights
    assert not torch.equal(_eval_logits(other, ids), _eval_logits(fused, ids))
    assert fxrewrite.explain(other).applied_patterns() == fxrewrite.explain(fused).applied_patterns()


def test_pickled_model_keeps_activation_checkpointing():
    fused = fxrewrite.optimize(tiny_model("llama"))
    fused.gradient_checkpointing_enable()
    fused.disable_input_require_grads()  # its hook is a local function: a stock model cannot be pickled with it
    other = pickle.loads(pickle.dumps(fused))
    calls = []
    for layer in other.model.layers:
        inner = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, _inner=inner, **k: calls.append(1) or _inner(*a, **k)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    loss, _ = _loss_and_grads(other, ids)
    assert len(calls) == len(other.model.layers)
    torch.testing.assert_close(loss, _loss_and_grads(fused, ids)[0], rtol=1e-6, atol=1e-6)


def _repo_root():
    import pathlib

    return pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("arch", ["gemma2", "qwen3"])  # gemma2: a soft-capped logits transform
def test_pickle_after_a_training_step(arch):
    """The loss module's deferred LM-head job of the last training call (hidden states, labels, the logits transform
    as a local function) is not part of a copy: pickling after a training step works and trains like the original."""
    fused = fxrewrite.optimize(tiny_model(arch))
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(7))
    _loss_and_grads(fused, ids)
    other = pickle.loads(pickle.dumps(fused))
    assert other.lm_head_loss.deferred is None
    want_loss, want_grads = _loss_and_grads(fused, ids)
    loss, grads = _loss_and_grads(other, ids)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
