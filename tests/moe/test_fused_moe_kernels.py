"""Fused MoE kernels: routing, alignment, Triton grouped GEMM (interpreter) vs the torch reference."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.benchmarks.moe_direct_sweep import DOWN_TILES, GATE_UP_TILES
from fxrewrite.kernels import fused_moe
from fxrewrite.kernels.fused_moe import fused_experts, fused_experts_ref, moe_align_block_size, select_experts
from fxrewrite.kernels.fused_moe_direct import DIRECT_MAX_TOKENS, direct_experts
from tests.moe.conftest import expert_inputs as _inputs




def test_select_experts_matches_softmax_topk():
    logits = torch.randn(5, 8)
    w, ids = select_experts(logits, 3, renormalize=False)
    probs = logits.softmax(-1)
    torch.testing.assert_close(w, probs.gather(1, ids))
    assert (w.min(1).values >= probs.topk(4).values[:, 3] - 1e-7).all()
    w, _ = select_experts(logits, 3, renormalize=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(5))
    w, ids = select_experts(logits, 2, renormalize=False, scoring_func="sigmoid")
    torch.testing.assert_close(w, logits.sigmoid().gather(1, ids))


def test_select_experts_bad_input():
    with pytest.raises(ValueError, match="top_k=9 must be between 1 and the number of experts \\(8\\)"):
        select_experts(torch.randn(2, 8), 9, True)
    with pytest.raises(ValueError, match="scoring_func"):
        select_experts(torch.randn(2, 8), 2, True, scoring_func="relu")


@pytest.mark.parametrize("start", [0, 3])
def test_align_block_size_groups_slots_by_expert(start):
    ids = torch.tensor([[0, 5], [3, 4], [3, 0], [1, 3], [4, 2]])
    block, e = 4, 3
    sorted_ids, expert_ids = moe_align_block_size(ids, block, e, start)
    flat = ids.reshape(-1)
    seen = []
    for b, expert in enumerate(expert_ids.tolist()):
        slots = [s for s in sorted_ids[b * block:(b + 1) * block].tolist() if s < flat.numel()]
        if expert < 0:
            assert not slots
            continue
        assert all(flat[s].item() - start == expert for s in slots)
        seen += slots
    local = [s for s in range(flat.numel()) if 0 <= flat[s].item() - start < e]
    assert sorted(seen) == local  # every local slot exactly once, remote ones dropped


def test_reference_matches_dense_formula():
    x, w13, w2, weights, ids = _inputs()
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            gate, up = (w13[ids[t, k]] @ x[t]).chunk(2)
            want[t] += weights[t, k] * (w2[ids[t, k]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(fused_experts_ref(x, w13, w2, weights, ids), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("start", [0, 2])
def test_triton_forward_backward_match_reference(interpret, monkeypatch, start):
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    x, w13, w2, weights, ids = _inputs()
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, weights)]
    ref_leaves = [t.clone().requires_grad_() for t in (x, w13, w2, weights)]
    got = fused_experts(*leaves[:3], leaves[3], ids, start)
    want = fused_experts_ref(*ref_leaves[:3], ref_leaves[3], ids, start)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, leaves, grad)
    want_grads = torch.autograd.grad(want, ref_leaves, grad)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the inference path (no autograd Function, nothing saved)
        torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, start), want.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,start", [(1, 0), (3, 2), (DIRECT_MAX_TOKENS + 1, 0)])
def test_inference_paths_match_reference(interpret, monkeypatch, t, start):
    """No autograd: up to DIRECT_MAX_TOKENS the direct GEMV kernels, above them the grouped GEMMs;
    odd sizes (H=24, I=20: masked tiles) and expert parallelism (slots of other ranks' experts)."""
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    x, w13, w2, weights, ids = _inputs(t=t)
    calls = []
    monkeypatch.setattr(fused_moe, "direct_experts", lambda *a, **kw: calls.append(1) or direct_experts(*a, **kw))
    with torch.no_grad():
        got = fused_experts(x, w13, w2, weights, ids, start)
    assert bool(calls) == (t <= DIRECT_MAX_TOKENS)
    torch.testing.assert_close(got, fused_experts_ref(x, w13, w2, weights, ids, start), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,start", [(1, 0), (3, 2), (DIRECT_MAX_TOKENS + 1, 0)])
def test_inference_paths_add_the_residual(interpret, monkeypatch, t, start):
    """``residual=`` (the decoder layer's closing add): residual + the experts' output on every inference path;
    on the direct path the add in the down kernel rounds as torch's add of the rounded output does (float16:
    the same bits as direct_experts then ``+``)."""
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    x, w13, w2, weights, ids = _inputs(t=t)
    residual = torch.randn_like(x)
    with torch.no_grad():
        got = fused_experts(x, w13, w2, weights, ids, start, residual=residual)
        torch.testing.assert_close(got, residual + fused_experts_ref(x, w13, w2, weights, ids, start),
                                   rtol=1e-5, atol=1e-5)
        half = [v.half() for v in (x, w13, w2, residual)]
        got = direct_experts(*half[:3], weights, ids, start, residual=half[3])
        assert got.dtype == torch.float16
        assert torch.equal(got, half[3] + direct_experts(*half[:3], weights, ids, start))
        # another dtype (autocast's bf16 residual beside a float32 x): torch's promoting add
        got = fused_experts(x, w13, w2, weights, ids, start, residual=residual.bfloat16())
        assert got.dtype == torch.float32
        assert torch.equal(got, residual.bfloat16() + fused_experts(x, w13, w2, weights, ids, start))
    with pytest.raises(ValueError, match=rf"residual \({t}, 5\) must match x \({t}, 24\)"):
        fused_experts(x, w13, w2, weights, ids, start, residual=residual[:, :5])


def test_direct_kernels_multi_tile(interpret):
    """Several N tiles and reduction chunks per program (tiles smaller than H and I)."""
    x, w13, w2, weights, ids = _inputs(t=2, h=40, i=36, e=5, k=3)
    cfg = dict(gate_up=dict(block_n=8, block_k=16, num_warps=1), down=dict(block_n=16, block_k=16, num_warps=1))
    torch.testing.assert_close(direct_experts(x, w13, w2, weights, ids, 1, cfg),
                               fused_experts_ref(x, w13, w2, weights, ids, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gate_up,down", [((16, 256, 4), (1, 256, 2)), ((4, 512, 8), (4, 128, 8))])
def test_direct_kernels_eight_experts_per_token(interpret, gate_up, down):
    """Top-8 of 10 experts with expert parallelism (2 of them remote): the down kernel's [K, rows,
    chunk] tile with all eight slots, one-row and four-row tiles, a chunk wider than I (masked)."""
    x, w13, w2, weights, ids = _inputs(t=3, h=24, i=20, e=8, k=8)
    ids = torch.stack([torch.randperm(10, generator=torch.Generator().manual_seed(r))[:8] for r in range(3)])
    cfg = {name: dict(block_n=c[0], block_k=c[1], num_warps=c[2]) for name, c in (("gate_up", gate_up), ("down", down))}
    torch.testing.assert_close(direct_experts(x, w13, w2, weights, ids, 2, cfg),
                               fused_experts_ref(x, w13, w2, weights, ids, 2), rtol=1e-5, atol=1e-5)


def test_shape_errors_name_the_shapes():
    x, w13, w2, weights, ids = _inputs()
    with pytest.raises(ValueError, match="expected x \\[T, H\\]"):
        fused_experts_ref(x[:, :5], w13, w2, weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_experts_ref(x, w13, w2, weights[:3], ids)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 8, 9, 64, 1024])
def test_triton_bf16_on_gpu(t):
    torch.manual_seed(0)
    e, h, i, k = 128, 2048, 768, 8
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.02
    weights, ids = select_experts(torch.randn(t, e, device="cuda"), k, True)
    got = fused_experts(x, w13, w2, weights, ids)
    want = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_triton_backward_and_cuda_graph_on_gpu():
    torch.manual_seed(0)
    e, h, i, k, t = 16, 256, 128, 4, 96
    x = (torch.randn(t, h, device="cuda") * 0.5).requires_grad_()
    w13 = (torch.randn(e, 2 * i, h, device="cuda") * 0.05).requires_grad_()
    w2 = (torch.randn(e, h, i, device="cuda") * 0.05).requires_grad_()
    weights, ids = select_experts(torch.randn(t, e, device="cuda"), k, True)
    weights.requires_grad_()
    got = fused_experts(x, w13, w2, weights, ids)
    want = fused_experts_ref(x, w13, w2, weights, ids)
    grad = torch.randn_like(got)
    for g, w in zip(torch.autograd.grad(got, (x, w13, w2, weights), grad),
                    torch.autograd.grad(want, (x, w13, w2, weights), grad)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    # No host sync: the inference path can be captured in a CUDA graph (the engine's decode graphs).
    xs, ws, ids_s = x.detach().bfloat16(), weights.detach(), ids.clone()
    w13b, w2b = w13.detach().bfloat16(), w2.detach().bfloat16()
    with torch.no_grad():
        fused_experts(xs, w13b, w2b, ws, ids_s)  # warm-up compiles the kernels
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_experts(xs, w13b, w2b, ws, ids_s)
        ids_s.copy_(torch.randint(0, e, ids_s.shape, device="cuda"))
        graph.replay()
        torch.testing.assert_close(out.float(), fused_experts_ref(xs.float(), w13b.float(), w2b.float(), ws, ids_s),
                                   rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("start", [0, 64])
def test_direct_path_cuda_graph_on_gpu(start):
    """The decode path (T <= DIRECT_MAX_TOKENS) replays in a CUDA graph with new routing; with
    expert parallelism (start 64: half the experts held) remote slots add zero; with a residual (the layer's
    closing add, in the down kernel) the same bits as bf16 ``residual + out``."""
    torch.manual_seed(0)
    e, h, i, k, t = 128, 2048, 768, 8, 2
    held = slice(start, start + 64) if start else slice(0, e)
    x, residual = (torch.randn(t, h, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w13 = (torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02)[held].contiguous()
    w2 = (torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.02)[held].contiguous()
    weights, ids = select_experts(torch.randn(t, e, device="cuda"), k, True)
    with torch.no_grad():
        fused_experts(x, w13, w2, weights, ids, start, residual=residual)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_experts(x, w13, w2, weights, ids, start)
            summed = fused_experts(x, w13, w2, weights, ids, start, residual=residual)
        ids.copy_(torch.randperm(e, device="cuda")[: t * k].view(t, k))
        graph.replay()
    want = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids, start)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    assert torch.equal(summed, residual + out)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8])
def test_every_sweep_tile_is_correct_on_gpu(t):
    """Each tile candidate the sweep times (Qwen3-30B-A3B shapes, bf16) gives the reference's output, so
    whichever the sweep finds fastest can become `direct_config`'s choice."""
    torch.manual_seed(t)
    e, h, i, k = 128, 2048, 768, 8
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.02
    weights, ids = select_experts(torch.randn(t, e, device="cuda"), k, True)
    want = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    for gate_up, down in zip(GATE_UP_TILES, DOWN_TILES):
        cfg = {n: dict(block_n=c[0], block_k=c[1], num_warps=c[2]) for n, c in (("gate_up", gate_up), ("down", down))}
        torch.testing.assert_close(direct_experts(x, w13, w2, weights, ids, 0, cfg).float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_direct_sweep_runs_on_gpu():
    """The benchmark's sweep (small shapes): a row per tile candidate, per router launch shape and for the
    GEMM + top-k pair, positive rates."""
    from fxrewrite.benchmarks.moe_direct_sweep import direct_sweep
    from fxrewrite.kernels.moe_router import ROUTER_CONFIGS

    e, h, i, k, t = 16, 256, 128, 4, 2
    layers = [(torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16),
               torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16)) for _ in range(2)]
    weights, ids = select_experts(torch.randn(t, e, device="cuda"), k, True)
    rows = direct_sweep(torch.randn(t, h, device="cuda", dtype=torch.bfloat16), layers, weights, ids)
    assert len(rows) == len(GATE_UP_TILES) + len(DOWN_TILES) + len(ROUTER_CONFIGS) + 1
    assert all(r["TBps"] > 0 for r in rows)


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", ["grouped_mm", "triton"])
@pytest.mark.parametrize("start", [0, 64])
def test_bf16_training_paths_on_gpu(monkeypatch, gemm, start):
    """Both training paths (torch's grouped GEMM, the default, and the Triton grouped GEMM) at Qwen3-30B-A3B's expert
    shapes in bf16: output and gradients within bf16 error of the float32 reference (relative norm), with and
    without experts held elsewhere (expert parallelism)."""
    from fxrewrite.kernels.fused_moe_grouped_mm import grouped_mm_applies

    monkeypatch.setenv("FXREWRITE_MOE_TRAIN_GEMM", gemm)
    torch.manual_seed(0)
    e, h, i, k, t = 64, 2048, 768, 8, 515
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.02
    weights, ids = select_experts(torch.randn(t, 2 * e if start else e, device="cuda"), k, True)
    assert grouped_mm_applies(x, w13, w2) == (gemm == "grouped_mm")
    leaves = [v.clone().requires_grad_() for v in (x, w13, w2, weights)]
    got = fused_experts(*leaves, ids, start)
    dy = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, leaves, dy)
    ref_leaves = [v.float().requires_grad_() for v in (x, w13, w2, weights)]
    want = fused_experts_ref(*ref_leaves, ids, start)
    want_grads = torch.autograd.grad(want, ref_leaves, dy.float())
    for name, g, w in zip(("out", "x", "w13", "w2", "weights"), (got, *got_grads), (want, *want_grads)):
        err = float((g.float() - w).norm() / w.norm().clamp_min(1e-12))
        assert err < 1e-2, (name, err)
