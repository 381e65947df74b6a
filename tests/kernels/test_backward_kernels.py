"""Training kernels (Triton forward + backward, in the interpreter) vs autograd through their torch references."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels import activation_backward as act_mod
from fxrewrite.kernels import rotary_backward as rot_mod
from fxrewrite.kernels.activation import gelu_and_mul_ref, silu_and_mul_ref
from fxrewrite.kernels.activation_backward import ActAndMulFunction, act_and_mul_train
from fxrewrite.kernels.rms_norm import rms_norm_ref
from fxrewrite.kernels.rms_norm_backward import RMSNormFunction, rms_norm_train
from fxrewrite.kernels.rotary_backward import RotaryApplyFunction, rotary_apply_ref, rotary_apply_train


def _grads(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(7)
    loss = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [t.grad for t in inputs if t.requires_grad]


def _close(got, want, tol=1e-5):
    assert len(got) == len(want), (len(got), len(want))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


@pytest.fixture
def forced(interpret, monkeypatch):
    monkeypatch.setenv("FXREWRITE_TRITON", "1")


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_grads(forced, offset, with_residual):
    x, w = torch.randn(3, 5, 40, requires_grad=True), torch.randn(40, requires_grad=True)
    res = torch.randn(3, 5, 40, requires_grad=True) if with_residual else None
    args = (x, w) + ((res,) if with_residual else ())

    def make(fn):
        return lambda x, w, *r: fn(x, w, 1e-6, r[0] if r else None, offset)

    got = _grads(make(rms_norm_train), *args)
    want = _grads(make(rms_norm_ref), *args)
    _close(got[0], want[0])
    _close(got[1], want[1])


def test_rms_norm_train_uses_the_function(forced, monkeypatch):
    calls = []
    original = RMSNormFunction.apply
    monkeypatch.setattr(RMSNormFunction, "apply", lambda *a: calls.append(1) or original(*a))
    rms_norm_train(torch.randn(2, 8, requires_grad=True), torch.randn(8), 1e-6)
    assert calls


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_act_and_mul_grads(forced, act, monkeypatch):
    # spies: the Triton forward (through ActAndMulFunction) and the Triton backward launcher must both run
    applies, fwd, bwd = [], [], []
    apply, fwd_launch, bwd_launch = ActAndMulFunction.apply, act_mod._act_and_mul_triton, act_mod._backward
    monkeypatch.setattr(ActAndMulFunction, "apply", lambda *a: applies.append(a[1]) or apply(*a))
    monkeypatch.setattr(act_mod, "_act_and_mul_triton",
                        lambda x, code, **kw: fwd.append(code) or fwd_launch(x, code, **kw))
    monkeypatch.setattr(act_mod, "_backward",
                        lambda x2, dy2, dx, code: bwd.append(code) or bwd_launch(x2, dy2, dx, code))
    # seeded: unseeded inputs made a rare element miss the 1e-5 absolute tolerance (float32 tanh-GELU)
    x = torch.randn(4, 3, 2 * 24, generator=torch.Generator().manual_seed(0)) * 3
    ref = {"silu": silu_and_mul_ref, "gelu": gelu_and_mul_ref,
           "gelu_tanh": lambda t: gelu_and_mul_ref(t, "tanh")}[act]
    got = _grads(lambda t: act_and_mul_train(t, act), x.detach().requires_grad_())
    want = _grads(ref, x.detach().requires_grad_())
    code = {"silu": 0, "gelu": 1, "gelu_tanh": 2}[act]
    assert (applies, fwd, bwd) == ([act], [code], [code])  # the kernels ran (not autograd through the ref)
    _close(got[0], want[0])
    _close(got[1], want[1])


def test_act_and_mul_inplace_backward(forced):
    """The in-place backward writes the gradient over the saved input; a kept graph gets a new buffer,
    so a second backward gives the same gradient again."""
    gen = torch.Generator().manual_seed(3)
    x, dy = torch.randn(4, 3, 2 * 24, generator=gen) * 3, torch.randn(4, 3, 24, generator=gen)
    ref = x.clone().requires_grad_()
    silu_and_mul_ref(ref).backward(dy)
    leaf = x.clone().requires_grad_()
    fused = leaf * 1.0  # in a model: the gate_up linear's fresh output
    act_and_mul_train(fused, "silu", inplace_backward=True).backward(dy)
    _close([leaf.grad], [ref.grad])
    assert not torch.equal(fused.detach(), x)  # overwritten by its gradient
    leaf = x.clone().requires_grad_()
    out = act_and_mul_train(leaf * 1.0, "silu", inplace_backward=True)
    out.backward(dy, retain_graph=True)
    out.backward(dy)
    _close([leaf.grad], [2 * ref.grad])


def test_rms_norm_strided_input_saves_the_view(forced):
    """A q head slice of a fused QKV output: the function saves the view (no contiguous copy), same grads."""
    qkv = torch.randn(2, 5, 3 * 4 * 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)

    def norm(fn):
        return lambda qkv, w: fn(qkv[..., :32].view(2, 5, 4, 8).transpose(1, 2), w, 1e-6)

    got, want = _grads(norm(rms_norm_train), qkv, w), _grads(norm(rms_norm_ref), qkv, w)
    _close(got[0], want[0])
    _close(got[1], want[1])
    q = qkv.detach()[..., :32].view(2, 5, 4, 8).transpose(1, 2).requires_grad_()
    out = rms_norm_train(q, w, 1e-6)
    assert out.grad_fn.saved_tensors[0].data_ptr() == q.data_ptr()


def test_act_and_mul_rejects_odd_and_unknown():
    with pytest.raises(ValueError, match="even"):
        act_and_mul_train(torch.randn(2, 5))
    with pytest.raises(ValueError, match="relu"):
        act_and_mul_train(torch.randn(2, 4), "relu")


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [8, 4])
@pytest.mark.parametrize("cos_batch", [1, 2])
def test_rotary_grads(forced, neox, rotary_dim, cos_batch, monkeypatch):
    # spies: RotaryApplyFunction and its Triton launcher, forward (q, k) and backward (dq, dk), must run
    applies, launches = [], []
    apply, launch = RotaryApplyFunction.apply, rot_mod._launch
    monkeypatch.setattr(RotaryApplyFunction, "apply", lambda *a: applies.append(1) or apply(*a))
    monkeypatch.setattr(rot_mod, "_launch", lambda x, cos, sin, neox_, backward: launches.append((neox_, backward))
                        or launch(x, cos, sin, neox_, backward))
    B, S, D = 2, 5, 8
    q = torch.randn(B, S, 4, D).transpose(1, 2).requires_grad_()  # transformers' strided view
    k = torch.randn(B, 2, S, D, requires_grad=True)
    ang = torch.randn(cos_batch, S, rotary_dim)
    cos, sin = ang.cos(), ang.sin()  # halves differ: the kernel must not assume duplicated halves
    got = _grads(lambda q, k: rotary_apply_train(q, k, cos, sin, 1, neox), q, k)
    want = _grads(lambda q, k: rotary_apply_ref(q, k, cos, sin, neox), q, k)
    assert applies == [1]
    assert sorted(launches) == sorted([(neox, False)] * 2 + [(neox, True)] * 2)  # q, k forward; dq, dk backward
    _close(got[0], want[0])
    _close(got[1], want[1])


def test_rotary_grads_arriving_transposed(forced):
    """Eager attention's ``q @ k.transpose(2, 3)`` hands back dk with a non-unit last-dim stride (MiMo-V2-Flash's
    sliding layers, whose k is not repeated for groups: the optimize sweep found its k_proj gradient wrong)."""
    B, S, D = 1, 6, 16
    q, k = torch.randn(B, 4, S, D, requires_grad=True), torch.randn(B, 4, S, D, requires_grad=True)
    ang = torch.randn(1, S, 3)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()  # partial rotary: 6 of 16

    def scores(rotary):
        def fn(q, k):
            q_out, k_out = rotary(q, k)
            return q_out @ k_out.transpose(2, 3), k_out.transpose(2, 3) @ q_out  # dq and dk arrive transposed
        return fn

    got = _grads(scores(lambda q, k: rotary_apply_train(q, k, cos, sin)), q, k)
    want = _grads(scores(lambda q, k: rotary_apply_ref(q, k, cos, sin)), q, k)
    _close(got[0], want[0])
    _close(got[1], want[1])


def test_rotary_ref_is_transformers_apply():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    ang = torch.randn(2, 5, 4)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    for got, want in zip(rotary_apply_ref(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin), strict=True):
        assert torch.equal(got, want)


def test_rotary_falls_back_when_cos_needs_grad(forced, monkeypatch):
    monkeypatch.setattr(RotaryApplyFunction, "apply", lambda *a: pytest.fail("kernel used"))
    cos = torch.randn(1, 3, 8, requires_grad=True)
    rotary_apply_train(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), cos, cos.detach())
