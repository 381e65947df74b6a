"""The MoE block's RMSNorm folded into the router launch against rms_norm_ref + route_experts_ref, and
`FusedMoE.forward_norm` against the norm then the block."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels import moe_router
from fxrewrite.kernels.moe_norm_router import norm_route_experts, norm_route_experts_ref
from fxrewrite.kernels.triton_utils import listen_launches
from tests.moe.conftest import LaunchNames as _Launches


def _inputs(t, h, e, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden, residual = torch.randn(t, h, generator=gen), torch.randn(t, h, generator=gen)
    norm_w, w = torch.rand(h, generator=gen) + 0.5, torch.randn(e, h, generator=gen) * 0.3
    return [v.to(dtype) for v in (hidden, residual, norm_w, w)]


@pytest.mark.parametrize("config,t,h,e", [(moe_router.ROUTER_CONFIGS[0], 3, 100, 24),
                                          (moe_router.ROUTER_CONFIGS[-1], 3, 100, 24),
                                          (moe_router.ROUTER_CONFIGS[0], 1, 2100, 8)],
                         ids=["one-warp-argmax-one-shot", "four-warp-ranked-one-shot", "one-warp-chunked"])
def test_norm_router_matches_norm_then_router(triton_on, config, t, h, e):
    """Hidden 100 (the row in one load) or 2100 (too wide for one warp's registers: chunks, the last one
    masked), several expert blocks: one launch; the routing, the normed rows and the new residual equal
    rms_norm_ref then route_experts_ref; the arrival counters are back at zero."""
    hidden, residual, norm_w, w = _inputs(t, h, e, seed=1)
    launches = _Launches()
    with listen_launches(launches):
        got = norm_route_experts(hidden, residual, norm_w, 1e-6, w, 4, True, config=config)
    want = norm_route_experts_ref(hidden, residual, norm_w, 1e-6, w, 4, True)
    assert launches.names == ["_norm_router_kernel"]
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[3], want[3])
    assert not moe_router.counters(hidden.device).any()


def test_norm_router_half_rounds_like_rms_norm(triton_on):
    """float16 (the interpreter has no bf16 arithmetic): the add and the normed row round in the input
    dtype as rms_norm does (rows equal to 1 ulp)."""
    hidden, residual, norm_w, w = _inputs(2, 64, 16, torch.float16, seed=2)
    got = norm_route_experts(hidden, residual, norm_w, 1e-6, w, 4, True)
    want = norm_route_experts_ref(hidden, residual, norm_w, 1e-6, w, 4, True)
    assert torch.equal(got[3], want[3]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=1e-2, atol=1e-2)


def test_norm_router_stores_weights_rounded_to_the_asked_dtype(triton_on):
    """`weights_dtype` (as `route_experts`'): the launch stores the routing weights rounded to it."""
    hidden, residual, norm_w, w = _inputs(2, 64, 16, seed=4)
    want = norm_route_experts(hidden, residual, norm_w, 1e-6, w, 4, True)
    got = norm_route_experts(hidden, residual, norm_w, 1e-6, w, 4, True, weights_dtype=torch.float16)
    assert got[0].dtype == torch.float16 and torch.equal(got[0], want[0].to(torch.float16))
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])


def test_gemm_choice_and_many_tokens_take_norm_then_router(triton_on):
    """The GEMM router choice, or more tokens than the fused router takes: rms_norm then the router."""
    hidden, residual, norm_w, w = _inputs(moe_router.FUSED_ROUTER_MAX_TOKENS + 1, 32, 8, seed=3)
    launches = _Launches()
    with listen_launches(launches):
        got = norm_route_experts(hidden, residual, norm_w, 1e-6, w, 2, False)
        small = norm_route_experts(hidden[:2], residual[:2], norm_w, 1e-6, w, 2, False, config=moe_router.GEMM)
    assert "_norm_router_kernel" not in launches.names and "rms_norm_kernel" in launches.names
    for g, r in zip(got + small, norm_route_experts_ref(hidden, residual, norm_w, 1e-6, w, 2, False)
                    + norm_route_experts_ref(hidden[:2], residual[:2], norm_w, 1e-6, w, 2, False)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-expert", "no-shared-expert"])
@pytest.mark.parametrize("add_residual", [False, True], ids=["out", "residual-plus-out"])
def test_fused_moe_forward_norm_equals_norm_then_block(triton_on, shared, add_residual):
    """`FusedMoE.forward_norm` (fused router with the norm, direct experts) = the layer's RMSNorm with the
    residual add, then the block, then (``add_residual``) the layer's closing ``residual + out``; with a shared
    expert and its gate (Qwen2-MoE's form) or without (the closing add then in the down kernel)."""
    from fxrewrite.layers.fused_moe import FusedExperts, FusedMoE
    from fxrewrite.layers.layernorm import RMSNorm

    torch.manual_seed(0)
    router, experts = torch.nn.Linear(32, 8, bias=False), FusedExperts(8, 32, 16)
    torch.nn.init.normal_(experts.w13, std=0.2), torch.nn.init.normal_(experts.w2, std=0.2)
    names, modules = {"router": "gate", "experts": "experts"}, {"router": router, "experts": experts}
    if shared:
        names.update(shared="shared_expert", shared_gate="shared_expert_gate")
        modules.update(shared=torch.nn.Linear(32, 32, bias=False), shared_gate=torch.nn.Linear(32, 1, bias=False))
    moe = FusedMoE(names, modules, top_k=2, renormalize=True)
    norm = RMSNorm(32, 1e-6)
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    hidden, residual = torch.randn(2, 32), torch.randn(2, 32)
    launches = _Launches()
    with torch.no_grad(), listen_launches(launches):
        got, got_res = moe(hidden, norm=norm, residual=residual, add_residual=add_residual)
    with torch.no_grad():
        x, want_res = norm(hidden, residual)
        want = want_res + moe(x) if add_residual else moe(x)
    assert launches.names == ["_norm_router_kernel", "_direct_gate_up_kernel", "_direct_down_kernel"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_res, want_res)


@pytest.mark.gpu
@pytest.mark.parametrize("config", moe_router.ROUTER_CONFIGS, ids=lambda c: "/".join(map(str, map(int, c))))
def test_norm_router_cuda_graph_on_gpu(config):
    """Qwen3-30B-A3B's router (128 experts, top-8, H=2048) with its norm, every launch shape, T = 1 and 8:
    graph replays with new hidden states equal the float32 reference (no bf16 ties)."""
    torch.manual_seed(0)
    w, norm_w = torch.randn(128, 2048, device="cuda") * 0.05, torch.rand(2048, device="cuda") + 0.5
    for t in (1, 8):
        hidden, residual = torch.randn(t, 2048, device="cuda"), torch.randn(t, 2048, device="cuda")
        norm_route_experts(hidden, residual, norm_w, 1e-6, w, 8, True, config=config)  # compile outside
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = norm_route_experts(hidden, residual, norm_w, 1e-6, w, 8, True, config=config)
        for _ in range(5):
            hidden.copy_(torch.randn_like(hidden)), residual.copy_(torch.randn_like(residual))
            graph.replay()
            want = norm_route_experts_ref(hidden, residual, norm_w, 1e-6, w, 8, True)
            assert torch.equal(got[1], want[1]) and torch.equal(got[3], want[3])
            torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)
