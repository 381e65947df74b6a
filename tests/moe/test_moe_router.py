"""The fused router (gate GEMV + scores + top-k in one launch) against F.linear + select_experts_ref."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels import moe_router
from fxrewrite.kernels.moe_router import FUSED_ROUTER_MAX_TOKENS, route_experts, route_experts_ref
from fxrewrite.kernels.triton_utils import listen_launches
from tests.moe.conftest import LaunchNames as _Launches


def _inputs(t, h, e, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, generator=gen) * 0.2).to(dtype), torch.randn(e, h, generator=gen).to(dtype)


@pytest.mark.parametrize("t,h,e,k,scoring,renormalize", [
    (1, 40, 8, 2, "softmax", True), (3, 300, 12, 4, "sigmoid", True), (8, 64, 6, 3, "softmax", False),
    (2, 32, 128, 8, "softmax", True)])
def test_fused_router_matches_reference(triton_on, t, h, e, k, scoring, renormalize):
    """Several expert blocks per token (e > 4), hidden not a power of two (masked chunks); the arrival
    counters are back at zero afterwards (the next launch, or a CUDA-graph replay, starts clean)."""
    x, w = _inputs(t, h, e, seed=t + e)
    launches = _Launches()
    with listen_launches(launches):
        got_w, got_ids = route_experts(x, w, k, renormalize, scoring)
    want_w, want_ids = route_experts_ref(x, w, k, renormalize, scoring)
    assert launches.names == ["_router_kernel"]
    assert torch.equal(got_ids, want_ids) and got_ids.dtype == torch.int64
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
    assert not moe_router.counters(x.device).any()


@pytest.mark.parametrize("config", moe_router.ROUTER_CONFIGS, ids=lambda c: "/".join(map(str, map(int, c))))
def test_every_router_config_matches_reference(triton_on, config):
    """Each launch shape the load-time tuner may choose (rows per program, warps, rank or argmax top-k)
    routes like the reference: 3 tokens, 48 experts (partial last block), hidden 100 (masked chunk)."""
    x, w = _inputs(3, 100, 48, seed=7)
    got_w, got_ids = route_experts(x, w, 6, True, config=config)
    want_w, want_ids = route_experts_ref(x, w, 6, True)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
    assert not moe_router.counters(x.device).any()


def test_router_choice_record_and_env(monkeypatch):
    """record() wins over FXREWRITE_ROUTER_CONFIG, which wins over the default; a malformed value is a
    clear error naming it."""
    assert moe_router.choice_for(9, 10, 2) == moe_router.ROUTER_CONFIGS[0]
    monkeypatch.setenv("FXREWRITE_ROUTER_CONFIG", "2/512/4/1")
    assert moe_router.choice_for(9, 10, 2) == moe_router.RouterConfig(2, 512, 4, True)
    moe_router.record(9, 10, 2, moe_router.GEMM)
    try:
        assert moe_router.choice_for(9, 10, 2) == moe_router.GEMM
    finally:
        moe_router.record(9, 10, 2, None)
    monkeypatch.setenv("FXREWRITE_ROUTER_CONFIG", "fast")
    with pytest.raises(ValueError, match="FXREWRITE_ROUTER_CONFIG='fast'"):
        moe_router.choice_for(9, 10, 2)


def test_router_tuner_records_the_fastest_checked_candidate(triton_on, monkeypatch):
    """The tuner (timings faked: no GPU here) skips a candidate that routes wrongly even when it is the
    fastest, and records the fastest of the rest."""
    from fxrewrite.kernels import moe_router_tune

    fastest, wrong = moe_router.ROUTER_CONFIGS[2], moe_router.ROUTER_CONFIGS[1]
    fake_us = {c: 5.0 for c in moe_router_tune.candidates()} | {fastest: 3.0, wrong: 1.0}
    monkeypatch.setattr(moe_router_tune, "graph_time_us", lambda fn, reps, copies: fake_us[fn.__defaults__[0]])
    real = moe_router_tune.route_experts

    def wrong_for_one(x, w, k, renormalize, scoring, config=None):
        weights, ids = real(x, w, k, renormalize, scoring, config=config)
        return (weights, ids.flip(-1) * 0) if config == wrong else (weights, ids)  # every slot expert 0

    monkeypatch.setattr(moe_router_tune, "route_experts", wrong_for_one)
    try:
        results = moe_router_tune.tune_shape(16, 64, 4, True, "softmax", "cpu", torch.float32)
        assert moe_router.choice_for(16, 64, 4) == fastest
    finally:
        moe_router.record(16, 64, 4, None)
    assert str(results["2/256/1/0"]).startswith("error: ValueError") and results["1/512/2/0"] == 3.0


def test_fused_router_rounds_logits_to_the_input_dtype(triton_on):
    """bf16 hidden states: the logits are rounded to bf16 before the float32 softmax, as F.linear's
    output is in transformers' routers (the scores then match within bf16 rounding of the logits)."""
    x, w = _inputs(2, 64, 16, torch.bfloat16, seed=3)
    got_w, got_ids = route_experts(x, w, 4, True)
    want_w, want_ids = route_experts_ref(x, w, 4, True)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=2e-2, atol=1e-3)


def test_fused_router_stores_weights_rounded_to_the_asked_dtype(triton_on):
    """`weights_dtype` (a router that casts its routing weights, as Qwen3-MoE's does to the logits' dtype): the
    launch stores the float32 weights rounded to it (float16 here: the interpreter has no bf16 arithmetic), the
    same values as a cast after, with no cast kernel."""
    x, w = _inputs(3, 64, 16, seed=5)
    want_w, want_ids = route_experts(x, w, 4, True)
    got_w, got_ids = route_experts(x, w, 4, True, weights_dtype=torch.float16)
    assert got_w.dtype == torch.float16 and torch.equal(got_w, want_w.to(torch.float16))
    assert torch.equal(got_ids, want_ids)


def test_fallbacks_take_the_gemm_path(triton_on):
    """More tokens than FUSED_ROUTER_MAX_TOKENS, a router bias, or autograd: no fused launch, same results."""
    launches = _Launches()
    x, w = _inputs(FUSED_ROUTER_MAX_TOKENS + 1, 32, 8)
    bias, wg = torch.randn(8), w.clone().requires_grad_()
    with listen_launches(launches):
        torch.testing.assert_close(route_experts(x, w, 2, True), route_experts_ref(x, w, 2, True))
        torch.testing.assert_close(route_experts(x[:2], w, 2, True, bias=bias),
                                   route_experts_ref(x[:2], w, 2, True, bias=bias))
        torch.testing.assert_close(route_experts(x[:2], wg, 2, True), route_experts_ref(x[:2], wg, 2, True))
    assert "_router_kernel" not in launches.names and "_select_experts_kernel" in launches.names


def test_bad_top_k_is_a_clear_error(triton_on):
    x, w = _inputs(1, 32, 8)
    with pytest.raises(ValueError, match="top_k=9"):
        route_experts(x, w, 9, True)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 8])
def test_fused_router_cuda_graph_on_gpu(t):
    """Qwen3-30B-A3B's router (128 experts, top-8, H=2048): replays of one captured launch with new
    hidden states give the reference's experts every time (float32: no bf16 ties)."""
    torch.manual_seed(t)
    w = torch.randn(128, 2048, device="cuda")
    x = torch.randn(t, 2048, device="cuda") * 0.05
    route_experts(x, w, 8, True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = route_experts(x, w, 8, True)
    for _ in range(20):
        x.copy_(torch.randn_like(x) * 0.05)
        graph.replay()
        want_w, want_ids = route_experts_ref(x, w, 8, True)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_w, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_router_tuner_on_gpu():
    """Qwen3-30B-A3B's router shape in bf16: every fused launch shape passes the tuner's check (an error
    here is a kernel bug, not a slow config), each is timed, and the fastest is recorded."""
    from fxrewrite.kernels import moe_router_tune

    try:
        results = moe_router_tune.tune_shape(128, 2048, 8, True, "softmax", "cuda", torch.bfloat16)
        chosen = moe_router.choice_for(128, 2048, 8)
    finally:
        moe_router.record(128, 2048, 8, None)
    print("router tuner (us at T=1):", results)
    assert all(isinstance(v, float) for v in results.values()), results
    assert results[moe_router_tune._name(chosen)] == min(results.values())


@pytest.mark.parametrize("weights_dtype", ["float32", "logits"])
def test_fused_moe_layer_routes_decode_tokens_in_one_launch(interpret, monkeypatch, weights_dtype):
    """`FusedMoE` at decode (2 tokens, Triton on): the fused router and the two direct expert kernels,
    no GEMM + select pair; the output equals the torch path's (Triton off). A router that rounds its weights to
    the logits' dtype (float16 here): the router launch stores them so, and no cast follows."""
    from fxrewrite.layers.fused_moe import FusedExperts, FusedMoE

    torch.manual_seed(0)
    dtype = torch.float32 if weights_dtype == "float32" else torch.float16
    router, experts = torch.nn.Linear(32, 8, bias=False).to(dtype), FusedExperts(8, 32, 16).to(dtype)
    torch.nn.init.normal_(experts.w13, std=0.2), torch.nn.init.normal_(experts.w2, std=0.2)
    moe = FusedMoE({"router": "gate", "experts": "experts"}, {"router": router, "experts": experts},
                   top_k=2, renormalize=True, weights_dtype=weights_dtype)
    x = torch.randn(2, 32).to(dtype)
    rounding, casts = FusedMoE.round_routing_weights, []

    def spy(self, weights, x):
        out = rounding(self, weights, x)
        casts.append(out is not weights)
        return out
    monkeypatch.setattr(FusedMoE, "round_routing_weights", spy)
    with torch.no_grad():
        want = moe(x)
        monkeypatch.setenv("FXREWRITE_TRITON", "1")
        launches = _Launches()
        with listen_launches(launches):
            got = moe(x)
    assert launches.names == ["_router_kernel", "_direct_gate_up_kernel", "_direct_down_kernel"]
    assert casts == [weights_dtype == "logits", False]  # the torch path casts, the router launch stored them so
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
