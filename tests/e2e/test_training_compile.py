"""torch.compile of an optimized model in training: the fused linear cross-entropy is the custom op
``fxrewrite::fused_linear_cross_entropy`` (no graph break), loss and gradients equal to eager (float32, CPU);
the opt-in training-kernel custom ops (FXREWRITE_COMPILE_TRAIN_KERNELS=1) likewise."""

from __future__ import annotations

import pytest
import torch
from tests.e2e.tiny_models import tiny_model

import fxrewrite
from fxrewrite.kernels import activation_backward, rms_norm_backward  # noqa: F401 - registers their custom ops
from fxrewrite.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy_ref
from fxrewrite.kernels.fused_linear_cross_entropy_op import fused_linear_cross_entropy_op


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


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_compiled_training_step_matches_eager_without_graph_break(arch):
    from torch._dynamo.utils import counters

    model = fxrewrite.optimize(tiny_model(arch, num_hidden_layers=1).train()).train()
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[0, :3] = -100
    want_loss, want_grads = _step(model, model, ids, labels)
    torch._dynamo.reset()
    counters.clear()
    got_loss, got_grads = _step(torch.compile(model, backend="aot_eager"), model, ids, labels)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert abs(got_loss - want_loss) <= 1e-6 * abs(want_loss)
    assert set(got_grads) == set(want_grads)
    for name, g in want_grads.items():
        assert float((got_grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)) < 1e-5, name


def test_compiled_training_kernels_opt_in(monkeypatch):
    """FXREWRITE_COMPILE_TRAIN_KERNELS=1: RMSNorm and SiLU-and-mul enter the compiled graph as our custom ops
    (Triton in the interpreter here), same loss and gradients as eager, no graph break."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    monkeypatch.setenv("FXREWRITE_COMPILE_TRAIN_KERNELS", "1")
    model = fxrewrite.optimize(tiny_model("qwen3", num_hidden_layers=1).train()).train()
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    want_loss, want_grads = _step(model, model, ids, ids)
    seen = set()

    def backend(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    counters.clear()
    got_loss, got_grads = _step(torch.compile(model, backend=backend), model, ids, ids)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert any("rms_norm_train" in s for s in seen) and any("act_and_mul_train" in s for s in seen), seen
    assert abs(got_loss - want_loss) <= 1e-6 * abs(want_loss)
    for name, g in want_grads.items():
        assert float((got_grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)) < 1e-5, name


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
