"""torch.compile of an optimized model in training: loss and gradients equal to eager (float32, CPU), with the LM
head's gradient deferred (two graph breaks, fxrewrite.layers.deferred_head_grad) or, with FXREWRITE_DEFER_HEAD_GRAD=0,
the fused linear cross-entropy as the custom op ``fxrewrite::fused_linear_cross_entropy`` (no graph break);
the training-kernel custom ops (the default where the Triton kernels run; FXREWRITE_COMPILE_TRAIN_KERNELS=0: Inductor's
references) likewise, saving for the backward no more than the eager optimized step."""

from __future__ import annotations

import pytest
import torch
from tests.e2e.compile_breaks import assert_deferral_breaks, graph_breaks
from tests.e2e.tiny_models import tiny_model

import fxrewrite
from fxrewrite.kernels import activation_backward, gated_mlp_down, qk_norm_rope_op, rms_norm_backward  # noqa: F401 - ops
from fxrewrite.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy_ref
from fxrewrite.kernels.fused_linear_cross_entropy_op import fused_linear_cross_entropy_op
from fxrewrite.weights import to_hf_names


@pytest.mark.parametrize("scale,softcap,bias", [(1.0, None, False), (0.5, 3.0, True), (2.0, None, True)])
def test_op_matches_reference(scale, softcap, bias):
    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(11, 6, generator=gen), torch.randn(13, 6, generator=gen)
    b = torch.randn(13, generator=gen) if bias else None
    t = torch.randint(0, 13, (11,), generator=gen)
    t[2] = -100

    def transform(z):
        y = z * scale
        return softcap * torch.tanh(y / softcap) if softcap else y

    inputs = [x.clone().requires_grad_() for x in (h, w) + ((b,) if bias else ())]
    want = fused_linear_cross_entropy_ref(inputs[0], inputs[1], inputs[2] if bias else None, t, -100, transform)
    want_grads = torch.autograd.grad(want * 0.7, inputs)
    inputs = [x.clone().requires_grad_() for x in inputs]
    got = fused_linear_cross_entropy_op(inputs[0], inputs[1], inputs[2] if bias else None, t, -100, scale, softcap,
                                        chunk_size=4)
    got_grads = torch.autograd.grad(got * 0.7, inputs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, r in zip(got_grads, want_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_op_passes_opcheck():
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(5, 4, generator=gen, requires_grad=True)
    w = torch.randn(7, 4, generator=gen, requires_grad=True)
    t = torch.randint(0, 7, (5,), generator=gen)
    args = (h, w, None, t, -100, 1.0, 0.0, 2, 0, True, True, False)
    torch.library.opcheck(torch.ops.fxrewrite.fused_linear_cross_entropy.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def _step(runner, model, ids, labels):
    model.zero_grad()
    loss = runner(ids, labels=labels).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("defer", [True, False])
@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_compiled_training_step_matches_eager(arch, defer, monkeypatch):
    """Deferred head gradient: the deferral's two graph breaks and nothing else; switched off: no graph break."""
    from torch._dynamo.utils import counters

    if not defer:
        monkeypatch.setenv("FXREWRITE_DEFER_HEAD_GRAD", "0")
    model = fxrewrite.optimize(tiny_model(arch, num_hidden_layers=1).train()).train()
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[0, :3] = -100
    want_loss, want_grads = _step(model, model, ids, labels)
    torch._dynamo.reset()
    counters.clear()
    got_loss, got_grads = _step(torch.compile(model, backend="aot_eager"), model, ids, labels)
    if defer:
        assert_deferral_breaks()
    else:
        assert graph_breaks() == {}
    assert abs(got_loss - want_loss) <= 1e-6 * abs(want_loss)
    assert set(got_grads) == set(want_grads)
    for name, g in want_grads.items():
        assert float((got_grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)) < 1e-5, name


def _saved_bytes_eager(model, ids) -> int:
    """Bytes of the non-parameter floating tensors autograd saves in an eager step (per tensor, as the AOT graph)."""
    params = {p.data_ptr() for p in model.parameters()}
    total = 0

    def pack(t):
        nonlocal total
        if t.is_floating_point() and t.data_ptr() not in params:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, labels=ids).loss.backward()
    return total


@pytest.mark.parametrize("defer", [False, True])
def test_compiled_training_step_uses_kernel_ops(defer, monkeypatch):
    """Default under torch.compile where the Triton kernels run (here the interpreter): RMSNorm, the fused q/k-norm +
    rotary and act-and-mul + down_proj are our custom ops, loss and gradients equal to stock transformers (float32).
    FXREWRITE_DEFER_HEAD_GRAD=0: the loss is our op too, no graph break, and the AOT backward graphs receive no more
    saved activation bytes than the eager optimized step saves (with the LM head's gradient made in the loss's
    forward, as the compiled loss op does). Deferred (the default): the loss runs eagerly between the deferral's two
    graph breaks, the layers' ops unchanged."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from functorch.compile import make_boxed_func

    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    monkeypatch.delenv("FXREWRITE_COMPILE_TRAIN_KERNELS", raising=False)
    stock = tiny_model("qwen3", num_hidden_layers=1, use_cache=False).train()
    model = fxrewrite.optimize(tiny_model("qwen3", num_hidden_layers=1, use_cache=False).train()).train()
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    want_loss, want_grads = _step(stock, stock, ids, ids)
    if not defer:  # the compiled loss op makes the head's gradient in its forward: the eager step likewise
        monkeypatch.setenv("FXREWRITE_DEFER_HEAD_GRAD", "0")
    eager_saved = _saved_bytes_eager(model, ids)
    seen, saved = set(), []

    def fw(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm)

    def bw(gm, example_inputs):
        saved.extend(n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"
                     and not n.name.startswith(("primals", "tangents")))
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=fw, bw_compiler=bw, partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    counters.clear()
    got_loss, got_grads = _step(torch.compile(model, backend=backend), model, ids, ids)
    if defer:
        assert_deferral_breaks()
    else:
        assert graph_breaks() == {}
    for op in ("rms_norm_train", "qk_norm_rope_train", "act_and_mul_down_train", "fused_linear_cross_entropy"):
        assert any(f"fxrewrite.{op}." in s for s in seen) is not (defer and op == "fused_linear_cross_entropy"), op
    assert abs(got_loss - want_loss) <= 1e-6 * abs(want_loss)
    hf = to_hf_names(model, got_grads)
    assert set(hf) == set(want_grads)
    for name, g in want_grads.items():
        assert float((hf[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)) < 1e-5, name
    compiled_saved = sum(t.numel() * t.element_size() for t in saved if t.is_floating_point())
    assert 0 < compiled_saved <= eager_saved, (compiled_saved, eager_saved)  # deferred: the eager loss saves outside


def test_training_kernel_ops_pass_opcheck():
    from fxrewrite.kernels.triton_utils import interpreter_ready

    assert interpreter_ready()
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(2, 3, 3 * 2 * 8, generator=gen)
    q = qkv[..., :16].view(2, 3, 2, 8).transpose(1, 2).requires_grad_()  # a strided head slice
    w = torch.randn(8, generator=gen, requires_grad=True)
    x = torch.randn(4, 16, generator=gen, requires_grad=True)
    res = torch.randn(4, 16, generator=gen, requires_grad=True)
    checks = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    ops = torch.ops.fxrewrite
    torch.library.opcheck(ops.rms_norm_train.default, (q, w, None, 1e-6, 0.0), test_utils=checks)
    torch.library.opcheck(ops.rms_norm_train.default, (x, torch.randn(16, requires_grad=True), res, 1e-6, 1.0),
                          test_utils=checks)
    torch.library.opcheck(ops.act_and_mul_train.default, (torch.randn(3, 2, 16, generator=gen, requires_grad=True), 0),
                          test_utils=checks)


def test_down_and_qk_ops_pass_opcheck():
    gen = torch.Generator().manual_seed(3)
    checks = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    ops = torch.ops.fxrewrite
    x = torch.randn(2, 3, 16, generator=gen, requires_grad=True)
    w = torch.randn(5, 8, generator=gen, requires_grad=True)
    torch.library.opcheck(ops.act_and_mul_down_train.default, (x, w, None, 0), test_utils=checks)
    torch.library.opcheck(ops.act_and_mul_down_train.default, (x, w, torch.randn(5, requires_grad=True), 0),
                          test_utils=checks)
    qkv = torch.randn(2, 3, 4 * 8, generator=gen)
    q = qkv[..., :16].view(2, 3, 2, 8).transpose(1, 2).requires_grad_()  # strided head slices, as in a model
    k = qkv[..., 16:24].view(2, 3, 1, 8).transpose(1, 2).requires_grad_()
    cos, sin = torch.randn(1, 3, 8, generator=gen), torch.randn(1, 3, 8, generator=gen)
    qw, kw = (torch.randn(8, generator=gen, requires_grad=True) for _ in range(2))
    torch.library.opcheck(ops.qk_norm_rope_train.default, (q, k, cos, sin, qw, kw, 1e-6, 1e-6, True),
                          test_utils=checks)
