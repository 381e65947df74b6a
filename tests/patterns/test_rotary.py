"""Rotary pattern: cos/sin module replaced by get_rope's RotaryEmbedding (YaRN included), apply call fused."""

import sys
from pathlib import Path

import pytest
import torch

import fxrewrite
from fxrewrite.patterns.rotary import RotaryCosSin, apply_rotary_qk

from tests.e2e.tiny_models import tiny_model  # noqa: E402
from tests.kernels.conftest import interpret  # noqa: E402, F401  (the Triton-interpreter fixture)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 10000.0}


def _pair(**overrides):
    stock = tiny_model("llama", **overrides)
    fused = fxrewrite.optimize(tiny_model("llama", **overrides))
    return stock, fused


def test_attention_scaling_set_after_optimize_is_applied():
    """A fresh user's find: ``model.model.rotary_emb.attention_scaling = ...`` after optimize (transformers' rotary
    forward multiplies cos / sin by it at each call) was silently ignored, the logits 1-87% off; now cos / sin follow
    it (a YaRN factor and the default 1.0), and the fused table path returns once it is set back."""
    for overrides in ({}, {"rope_parameters": YARN, "max_position_embeddings": 131072}):
        stock, fused = _pair(**overrides)
        ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(1))
        proven = stock.model.rotary_emb.attention_scaling
        for value in (0.5, proven):
            for m in (stock, fused):
                m.model.rotary_emb.attention_scaling = value
            pos = torch.tensor([[0, 3, 40000]])
            for w, g in zip(stock.model.rotary_emb(torch.zeros(1), pos), fused.model.rotary_emb(torch.zeros(1), pos)):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
            with torch.no_grad():
                torch.testing.assert_close(fused.eval()(ids).logits, stock.eval()(ids).logits, rtol=1e-5, atol=1e-5)
            fused.train()(ids, labels=ids).loss.backward()
            stock.train()(ids, labels=ids).loss.backward()
            torch.testing.assert_close(fused.model.layers[0].self_attn.o_proj.weight.grad,
                                       stock.model.layers[0].self_attn.o_proj.weight.grad, rtol=1e-5, atol=1e-6)
            assert (fused.model.rotary_emb._rescale() is None) == (value == proven)


def test_yarn_cos_sin_and_logits_past_original_length():
    stock, fused = _pair(rope_parameters=YARN, max_position_embeddings=131072)
    assert isinstance(fused.model.rotary_emb, RotaryCosSin)
    assert fused.model.rotary_emb.rope.rope_type == "yarn"
    pos = torch.tensor([[0, 1, 4095, 32767, 32768, 40000, 65536, 131071]])
    x = torch.zeros(1)
    want, got = stock.model.rotary_emb(x, pos), fused.model.rotary_emb(x, pos)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert stock.model.rotary_emb.attention_scaling > 1.0  # yarn's mscale is applied
    for name in ("inv_freq", "original_inv_freq"):  # transformers' buffers still read (a fresh user's find)
        torch.testing.assert_close(getattr(fused.model.rotary_emb, name), getattr(stock.model.rotary_emb, name))
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(40000, 40006)[None]
    with torch.no_grad():
        torch.testing.assert_close(fused(ids, position_ids=pos).logits, stock(ids, position_ids=pos).logits,
                                   rtol=1e-5, atol=1e-5)


def test_rotary_module_refused_when_config_does_not_reproduce_it():
    model = tiny_model("llama")
    model.model.rotary_emb.inv_freq.mul_(1.5)  # the module no longer computes what the config says
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    fxrewrite.optimize(model)
    report = fxrewrite.explain(model)
    assert "rotary" not in report.applied_patterns()
    assert any(p == "rotary" and "reproduces" in r for _, p, r in report.skipped())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref, rtol=1e-5, atol=1e-6)


def test_apply_rotary_qk_matches_transformers_bitwise():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    for got, want in zip(apply_rotary_qk(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        assert torch.equal(got, want)


def test_apply_call_refused_when_function_differs():
    import transformers.models.llama.modeling_llama as llama

    original = llama.apply_rotary_pos_emb

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # GPT-J style: not what the op computes
        q2 = torch.stack((-q[..., 1::2], q[..., ::2]), dim=-1).flatten(-2)
        k2 = torch.stack((-k[..., 1::2], k[..., ::2]), dim=-1).flatten(-2)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + q2 * sin, k * cos + k2 * sin

    # as if the modeling file defined it: the foreign-patch check reads `__module__` and the code's file
    apply_rotary_pos_emb.__module__ = llama.__name__
    apply_rotary_pos_emb.__code__ = apply_rotary_pos_emb.__code__.replace(co_filename=llama.__file__)
    llama.apply_rotary_pos_emb = apply_rotary_pos_emb
    try:
        model = fxrewrite.optimize(tiny_model("llama"))
    finally:
        llama.apply_rotary_pos_emb = original
    report = fxrewrite.explain(model)
    assert "rotary_apply" not in report.applied_patterns()
    assert any(p == "rotary_apply" and "does not compute" in r for _, p, r in report.skipped())


@pytest.mark.parametrize("fused", [False, True], ids=["own-projections", "qkv-slices"])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_apply_rotary_emb_kernel_path_matches_torch_form(interpret, monkeypatch, rotary_dim, fused):
    """The engine's path (no grad, one batch row): the Triton kernel (into new tensors for a whole-head rotary, on
    copies for a partial one) gives `apply_rotary_qk`'s result (float32) and leaves the inputs untouched, whether
    q and k are views of their own projections or slices of a fused QKV output; with grad, the torch form runs."""
    from fxrewrite.patterns.rotary import ApplyRotaryEmb, apply_rotary_qk
    from fxrewrite.patterns.rotary_calls import kernel_applies as _kernel_applies

    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    torch.manual_seed(0)
    seq, dim = 5, 16
    if fused:  # QKVParallelLinear's output [1, S, (4 + 2 + 2) * D], split: neither q nor k dense
        q, k, _ = torch.randn(1, seq, 8 * dim).split([4 * dim, 2 * dim, 2 * dim], dim=-1)
        q, k = q.view(1, seq, 4, dim).transpose(1, 2), k.view(1, seq, 2, dim).transpose(1, 2)
    else:
        q = torch.randn(1, seq, 4, dim).transpose(1, 2)  # transformers' [B, H, S, D] views
        k = torch.randn(1, seq, 2, dim).transpose(1, 2)
    angles = torch.rand(1, seq, rotary_dim // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q0, k0 = q.clone(), k.clone()
    want_q, want_k = apply_rotary_qk(q, k, cos, sin)
    assert _kernel_applies(q, k, cos, 1)
    got_q, got_k = ApplyRotaryEmb()(q, k, cos, sin)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert not _kernel_applies(q.requires_grad_(), k, cos, 1)


def test_packed_cos_sin_is_built_once_per_forward_and_never_stale():
    from fxrewrite.patterns.rotary_calls import packed_cos_sin

    cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    positions, cache, settled = packed_cos_sin(cos, sin)
    torch.testing.assert_close(cache, torch.cat((cos[0, :, :4], sin[0, :, :4]), dim=-1))
    assert torch.equal(positions, torch.arange(5)) and not settled  # built by this call's launches
    _, again, settled = packed_cos_sin(cos, sin)
    assert again is cache and settled  # the next layer of the same forward reuses the table, launching nothing
    cos.mul_(2)  # changed in place: rebuilt
    torch.testing.assert_close(packed_cos_sin(cos, sin)[1][:, :4], cos[0, :, :4])
    other = cos.clone()  # another forward's tensors: rebuilt
    assert packed_cos_sin(other, sin)[1] is not cache


def test_packed_cos_sin_table_dies_with_its_cos():
    from fxrewrite.patterns import rotary_calls

    cos, sin = torch.randn(1, 3, 4), torch.randn(1, 3, 4)
    rotary_calls.packed_cos_sin(cos, sin)
    del cos
    assert rotary_calls._packed == ()


def test_packed_cos_sin_under_inference_mode():
    from fxrewrite.patterns.rotary_calls import packed_cos_sin

    with torch.inference_mode():  # how the engine runs: inference tensors have no version counter
        cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
        cache = packed_cos_sin(cos, sin)[1]
        assert packed_cos_sin(cos, sin)[1] is cache
        torch.testing.assert_close(cache[:, 4:], sin[0, :, :4])
