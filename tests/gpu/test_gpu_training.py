"""Training on the GPU: bf16 kernels' gradients, fused linear cross-entropy, a Qwen3 training step vs stock,
no graph break on the training kernels under torch.compile (a compiled step: only the deferred LM-head gradient's
two), the same for an MoE model with its fused experts as custom ops, optimize() of Qwen3-4B shapes."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu

from fxrewrite.benchmarks.common import load_bench_config  # noqa: E402
from fxrewrite.kernels.activation import silu_and_mul_ref  # noqa: E402
from fxrewrite.kernels.activation_backward import act_and_mul_train  # noqa: E402
from fxrewrite.kernels.fused_linear_cross_entropy import (fused_linear_cross_entropy,  # noqa: E402
                                                          fused_linear_cross_entropy_ref)
from fxrewrite.kernels.rms_norm import rms_norm_ref  # noqa: E402
from fxrewrite.kernels.rms_norm_backward import rms_norm_train  # noqa: E402
from fxrewrite.kernels.rotary_backward import rotary_apply_ref, rotary_apply_train  # noqa: E402


def _grad_pair(fn, ref, *inputs):
    outs = []
    for f in (fn, ref):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        y = f(*leaves)
        y = y if isinstance(y, tuple) else (y,)
        gen = torch.Generator(device="cuda").manual_seed(0)
        sum((o.float() * torch.randn(o.shape, device="cuda", generator=gen)).sum() for o in y).backward()
        outs.append(([o.detach() for o in y], [x.grad for x in leaves]))
    return outs


def _close(a, b, tol=2e-2):
    for x, y in zip(a, b):
        torch.testing.assert_close(x.float(), y.float(), rtol=tol, atol=tol)


def test_bf16_kernels_match_references():
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    got, want = _grad_pair(lambda x, r, w: rms_norm_train(x, w, 1e-6, r), lambda x, r, w: rms_norm_ref(x, w, 1e-6, r),
                           x, r, w)
    _close(got[0], want[0])
    _close(got[1][:2], want[1][:2])
    torch.testing.assert_close(got[1][2].float(), want[1][2].float(), rtol=2e-2, atol=2.0)  # sum over 4096 rows
    g = torch.randn(4096, 2 * 3072, device="cuda", dtype=torch.bfloat16)
    got, want = _grad_pair(lambda t: act_and_mul_train(t, "silu"), silu_and_mul_ref, g)
    _close(got[0], want[0])
    _close(got[1], want[1])
    q = torch.randn(8, 2048, 16, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(8, 8, 2048, 128, device="cuda", dtype=torch.bfloat16)
    ang = torch.randn(1, 2048, 64, device="cuda")
    cos, sin = torch.cat((ang, ang), -1).cos().bfloat16(), torch.cat((ang, ang), -1).sin().bfloat16()
    got, want = _grad_pair(lambda q, k: rotary_apply_train(q, k, cos, sin), lambda q, k: rotary_apply_ref(q, k, cos, sin),
                           q, k)
    _close(got[0], want[0])
    _close(got[1], want[1])


def test_bf16_qk_norm_rope_matches_the_unfused_kernels():
    """Qwen3-0.6B shapes: the fused q/k-norm + rotary kernel on views of a fused QKV output, vs the norm and
    rotary training kernels (the same roundings, so all but a few outputs equal, none more than a bf16 step
    apart; gradients within bf16 steps)."""
    from fxrewrite.kernels.qk_norm_rope_backward import QKNormRopeFunction

    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv0 = torch.randn(8, 2048, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    w0 = [torch.randn(128, device="cuda", generator=gen).bfloat16() for _ in range(2)]
    ang = torch.randn(1, 2048, 64, device="cuda", generator=gen)
    cos, sin = torch.cat((ang, ang), -1).cos().bfloat16(), torch.cat((ang, ang), -1).sin().bfloat16()

    def run(fn):
        qkv, ws = qkv0.clone().requires_grad_(), [w.clone().requires_grad_() for w in w0]
        q, k, _ = qkv.split([2048, 1024, 1024], -1)
        oq, ok = fn(q.view(8, 2048, 16, 128).transpose(1, 2), k.view(8, 2048, 8, 128).transpose(1, 2), *ws)
        g = torch.Generator(device="cuda").manual_seed(1)
        ((oq.float() * torch.randn(oq.shape, device="cuda", generator=g)).sum()
         + (ok.float() * torch.randn(ok.shape, device="cuda", generator=g)).sum()).backward()
        return oq.detach(), ok.detach(), qkv.grad, *(w.grad for w in ws)

    got = run(lambda q, k, wq, wk: QKNormRopeFunction.apply(q, k, cos, sin, wq, wk, 1e-6, 1e-6, True))
    want = run(lambda q, k, wq, wk: rotary_apply_train(rms_norm_train(q, wq, 1e-6), rms_norm_train(k, wk, 1e-6),
                                                       cos, sin))
    for g, w in zip(got[:2], want[:2]):  # the H200: 85 of 33.5M outputs one bf16 step apart (FMA contraction)
        assert (g != w).float().mean().item() < 1e-4
        torch.testing.assert_close(g.float(), w.float(), rtol=1.6e-2, atol=(w.float().abs() * 2**-7).max().item())
    _close([got[2]], [want[2]])
    for g, w in zip(got[3:], want[3:]):  # sums over 16384 tokens x heads
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=4.0)


def test_bf16_fused_linear_cross_entropy():
    h = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(151936, 1024, device="cuda", dtype=torch.bfloat16) * 0.02
    t = torch.randint(0, 151936, (4096,), device="cuda")
    t[::7] = -100
    got, want = _grad_pair(lambda h, w: fused_linear_cross_entropy(h, w, None, t, kernel_params=(1.0, None)),
                           lambda h, w: fused_linear_cross_entropy_ref(h, w, None, t), h, w)
    torch.testing.assert_close(got[0][0], want[0][0], rtol=1e-3, atol=1e-3)
    _close(got[1], want[1], tol=5e-2)


def test_fused_linear_cross_entropy_allocates_its_buffers_and_one_chunk():
    """The kernel path's peak: d/dhidden [N, H], d/dweight [V, H], the losses [N] and one [chunk, V] logits
    buffer, nothing per chunk (Qwen3-0.6B shapes, 512-row chunks)."""
    n, hdim, vocab, chunk = 16384, 1024, 151936, 512
    h = torch.randn(n, hdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hdim, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    t = torch.randint(0, vocab, (n,), device="cuda")
    fused_linear_cross_entropy(h, w, None, t, kernel_params=(1.0, None), chunk_size=chunk)  # warm up (Triton)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = fused_linear_cross_entropy(h, w, None, t, kernel_params=(1.0, None), chunk_size=chunk)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    expected = n * hdim * 2 + vocab * hdim * 2 + n * 4 + chunk * vocab * 2
    assert expected <= extra <= expected + (2 << 20), (extra, expected)
    assert torch.isfinite(loss)


def test_training_kernels_compile_without_graph_breaks():
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step(x, w):
        h, res = rms_norm_train(x, w, 1e-6, x * 2)
        return act_and_mul_train(h, "silu").float().sum() + res.float().sum()

    explanation = torch._dynamo.explain(step)(x, w)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch.compile(step, fullgraph=True)(x, w).backward()


def _qwen3(name: str, **overrides):
    import transformers

    cfg = dict(load_bench_config(name)["config"], **overrides)
    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def test_bf16_training_step_matches_stock():
    import fxrewrite

    stock = _qwen3("qwen3-0.6b", num_hidden_layers=4).train()
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    ids = torch.randint(0, 151936, (2, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    losses = []
    for model in (stock, fused):
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[1] - losses[0]) <= 1e-3 * losses[0]


def test_optimize_qwen3_4b_on_gpu():
    """The rewrite of a materialised bf16 Qwen3-4B on the GPU applies its patterns. How long it takes is measured by
    `python -m fxrewrite.benchmarks.optimize_sweep --device cuda` (a benchmark JSON), not asserted here."""
    import fxrewrite

    model = _qwen3("qwen3-4b")
    fxrewrite.optimize(model)
    torch.cuda.synchronize()  # the fused weights' copies run asynchronously
    assert {"qk_norm_rope", "qkv", "glu", "rms_norm"} <= set(fxrewrite.explain(model).applied_patterns())


@pytest.mark.parametrize("kernels,defer", [("references", True), ("custom-ops", True), ("custom-ops", False)])
def test_compiled_training_step_matches_stock(kernels, defer, monkeypatch):
    """torch.compile (Inductor) of an optimized, checkpointed Qwen3, the loss agreeing with stock eager. The LM
    head's gradient deferred (the default): the loss runs eagerly between the deferral's two graph breaks
    (fxrewrite.layers.deferred_head_grad) and nothing else breaks; FXREWRITE_DEFER_HEAD_GRAD=0: the loss is the custom
    op, no graph break. By default the norms, q/k-norm + rotary and act-and-mul + down_proj are our custom ops too
    (FXREWRITE_COMPILE_TRAIN_KERNELS=0: Inductor's fusion of their references)."""
    import fxrewrite
    from fxrewrite.benchmarks.train import enable_checkpointing
    from tests.e2e.compile_breaks import assert_deferral_breaks, graph_breaks
    from torch._dynamo.utils import counters

    if kernels == "references":
        monkeypatch.setenv("FXREWRITE_COMPILE_TRAIN_KERNELS", "0")
    else:
        monkeypatch.delenv("FXREWRITE_COMPILE_TRAIN_KERNELS", raising=False)
    if not defer:
        monkeypatch.setenv("FXREWRITE_DEFER_HEAD_GRAD", "0")
    # use_cache off as Trainer / TRL train (and the benchmark): else transformers' "use_cache=True is incompatible
    # with gradient checkpointing" warning_once is one more graph break (logging, dynamo 2.11 and 2.13)
    stock = _qwen3("qwen3-0.6b", num_hidden_layers=4, use_cache=False).train()
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    enable_checkpointing(stock)
    enable_checkpointing(fused)
    ids = torch.randint(0, 151936, (2, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    want = stock(ids, labels=ids).loss
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(fused)(ids, labels=ids)
    out.loss.backward()
    if defer:
        assert_deferral_breaks()
    else:
        assert graph_breaks() == {}
    assert out.logits is None
    assert abs(float(out.loss) - float(want)) <= 1e-3 * float(want)
    assert all(p.grad is not None for p in fused.parameters())


def test_compiled_moe_training_step_has_no_graph_break(monkeypatch):
    """torch.compile (Inductor) of an optimized, checkpointed Qwen3-MoE (Qwen3-30B-A3B's layer shapes, 2 layers): the
    fused experts are the custom ops ``fxrewrite::fused_experts_train`` / ``_backward`` (no graph break with
    FXREWRITE_DEFER_HEAD_GRAD=0), the loss within 1e-3 of stock eager, gradients as close to stock's as the eager
    optimized step's (bf16)."""
    import fxrewrite
    from fxrewrite.benchmarks.train import enable_checkpointing
    from fxrewrite.weights import to_hf_names
    from tests.e2e.compile_breaks import graph_breaks
    from torch._dynamo.utils import counters

    monkeypatch.setenv("FXREWRITE_DEFER_HEAD_GRAD", "0")
    stock = _qwen3("qwen3-30b-a3b", num_hidden_layers=2, use_cache=False).train()
    fused = fxrewrite.optimize(copy.deepcopy(stock)).train()
    compiled_model = copy.deepcopy(fused)
    for model in (stock, fused, compiled_model):
        enable_checkpointing(model)
    ids = torch.randint(0, 151936, (2, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    want = stock(ids, labels=ids).loss
    want.backward()
    fused(ids, labels=ids).loss.backward()
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(compiled_model)(ids, labels=ids)
    out.loss.backward()
    assert graph_breaks() == {}
    assert abs(float(out.loss.detach()) - float(want.detach())) <= 1e-3 * float(want.detach())
    # bf16: compiled and eager round differently (the router's softmax and top-k weights above all), so each is
    # measured against stock transformers' gradients: the compiled step's error within twice the eager step's
    eager = to_hf_names(fused, {n: p.grad for n, p in fused.named_parameters()})
    compiled = to_hf_names(compiled_model, {n: p.grad for n, p in compiled_model.named_parameters()})
    for name, p in stock.named_parameters():
        ref = p.grad.float()
        err_compiled = float((compiled[name].float() - ref).norm() / ref.norm().clamp_min(1e-12))
        err_eager = float((eager[name].float() - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err_compiled <= max(2 * err_eager, 1e-2), (name, err_compiled, err_eager)


def test_inplace_activation_backward_allocates_no_input_sized_buffer():
    x = torch.randn(4096, 2 * 3072, device="cuda", dtype=torch.bfloat16)
    peaks = []
    for inplace in (False, True):
        leaf = x.clone().requires_grad_()
        fresh = leaf * 1.0  # the gate_up linear's output in a model
        y = act_and_mul_train(fresh, "silu", inplace_backward=inplace)
        dy = torch.randn_like(y)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        y.backward(dy)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del leaf, fresh, y, dy
    assert peaks[0] - peaks[1] >= x.numel() * x.element_size() * 0.9, peaks


def test_bf16_act_and_mul_down_matches_reference_and_saves_no_activation():
    from fxrewrite.kernels.gated_mlp_down import act_and_mul_down_ref, act_and_mul_down_train

    g = torch.randn(8192, 2 * 3072, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16) * 0.02
    got, want = _grad_pair(lambda t, w: act_and_mul_down_train(t, w, None, "silu"),
                           lambda t, w: act_and_mul_down_ref(t, w, None, "silu"), g, w)
    _close(got[0], want[0])
    _close(got[1][:1], want[1][:1])
    # d/dweight sums 8192 rows: judged against a float32 oracle on the same bf16 inputs, not against the bf16
    # reference (its own act(gate) * up is rounded to bf16 before the matmul, ours is recomputed per chunk).
    oracle = _grad_pair(lambda t, w: act_and_mul_down_ref(t, w, None, "silu"),
                        lambda t, w: act_and_mul_down_ref(t, w, None, "silu"), g.float(), w.float())[0]
    err_got = (got[1][1].float() - oracle[1][1]).abs()
    err_ref = (want[1][1].float() - oracle[1][1]).abs()
    assert err_got.max() <= 1.5 * err_ref.max() and err_got.mean() <= 1.5 * err_ref.mean(), (
        err_got.max(), err_ref.max(), err_got.mean(), err_ref.mean())
    saved = []
    for fn in (act_and_mul_down_ref, act_and_mul_down_train):
        leaf = g.clone().requires_grad_()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        y = fn(leaf * 1.0, w, None, "silu")
        saved.append(torch.cuda.memory_allocated() - base - y.numel() * y.element_size())
        del leaf, y
    assert saved[0] - saved[1] >= 8192 * 3072 * 2 * 0.9, saved  # act(gate) * up [N, d] is not kept


def test_state_dict_parts_alias_cuda_memory_and_accelerate_saves_them_all(tmp_path):
    """On the GPU the state dict's q / k / v and gate / up are tensors of their own storages over the fused
    parameter's device memory (no copy: a write through one reaches the parameter), and accelerate's save_model
    writes every one of them (it keeps one name per storage)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from safetensors.torch import load_file

    import fxrewrite

    model = fxrewrite.optimize(_qwen3("qwen3-0.6b", num_hidden_layers=2))
    state = model.state_dict()
    k = state["model.layers.0.self_attn.k_proj.weight"]
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    assert k.is_cuda and k.untyped_storage().data_ptr() != qkv.untyped_storage().data_ptr()
    assert qkv.data_ptr() < k.data_ptr() < qkv.data_ptr() + qkv.numel() * qkv.element_size()
    try:
        Accelerator().save_model(model, tmp_path)
    finally:
        AcceleratorState._reset_state(True)
    saved = load_file(tmp_path / "model.safetensors")
    assert set(saved) == set(state) - {"lm_head.weight"}  # tied: accelerate keeps the embedding
    torch.testing.assert_close(saved["model.layers.0.self_attn.k_proj.weight"], k.cpu(), rtol=0, atol=0)
    k.zero_()
    torch.cuda.synchronize()
    q_rows = state["model.layers.0.self_attn.q_proj.weight"].shape[0]
    assert not qkv.detach()[q_rows:q_rows + k.shape[0]].any()
