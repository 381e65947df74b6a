"""MoE under tensor / expert parallelism on a CPU (gloo): greedy tokens equal TP=1's.

2 ranks: Qwen3-MoE (native; transformers+fusion with expert parallelism), Qwen2-MoE (shared
expert), Mixtral (expert parallel), OLMoE (q/k norm over all heads: statistics all-reduced; with fusion
and without, whose unfused attention is head-sharded too so the KV cache holds this rank's heads).
4 and 8 ranks (issue #18's configuration, tiny): Qwen3-MoE with expert parallelism.
Bad settings are refused before any worker starts.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch.multiprocessing as mp

from tests.distributed.tp_ranks import generate_tokens, make_llm
from tests.distributed.processes import join_or_fail, killed_on_error
from tests.moe.moe_ranks import ep_layout, moe_layout, short_tokens, spmd_rank

MOE = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def moe_dir(tiny_model_dir):
    def make(arch: str, **kwargs):
        return str(tiny_model_dir(arch, vocab="smollm2", **{**MOE[arch], **kwargs}))
    return make


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(world_size: int, cases, tmp_path) -> list:
    """[(what each rank wrote for the case: {"tokens", "layout"}, in rank order; TP=1's tokens; TP=1's layout)]
    per case (`moe_ranks.spmd_rank`, `moe_ranks.moe_layout`)."""
    out = tmp_path / f"ranks{world_size}.json"
    ctx = mp.start_processes(spmd_rank, args=(world_size, _free_port(), cases, str(out)), nprocs=world_size,
                             join=False, start_method="spawn")
    run = generate_tokens if world_size == 2 else short_tokens
    with killed_on_error(ctx):
        expected = []  # overlaps the ranks
        for path, impl, kwargs in cases:
            llm = make_llm(path, impl, fusion=kwargs.get("fusion", True))
            expected.append((run(llm), moe_layout(llm)))
    join_or_fail(ctx, timeout_s=600 if world_size == 2 else 900, what="MoE ranks")
    ranks = [json.loads((tmp_path / f"ranks{world_size}.json.{r}").read_text()) for r in range(world_size)]
    assert all(list(got) == [str(i) for i in range(len(cases))] for got in ranks)
    return [([got[str(i)] for got in ranks], tokens, layout) for i, (tokens, layout) in enumerate(expected)]


def _check_split(ranks: list[dict], tp1: dict, world_size: int, kwargs: dict) -> None:
    """Expert parallelism: rank r holds experts [r*E/ws, (r+1)*E/ws) whole; tensor parallelism: every expert,
    1/ws of its intermediate width; fusion=False (transformers' own experts modules): whole experts E/ws on each
    rank, with or without enable_expert_parallel (`sharding_moe.shard_transformers_experts`)."""
    assert tp1["world_size"] == 1 and len(tp1["experts_w13"]) >= 1
    for r, got in enumerate(ranks):
        layout = got["layout"]
        assert layout["world_size"] == world_size
        if kwargs.get("fusion", True) is False:
            assert tp1["fused"] == layout["fused"] == []
            assert layout["experts_w13"] == [[e // world_size, *rest] for e, *rest in tp1["experts_w13"]], r
            continue
        assert len(tp1["fused"]) == len(tp1["experts_w13"])  # every MoE layer is fused
        if kwargs.get("enable_expert_parallel"):
            want = ep_layout(tp1, world_size, r)
        else:
            want = {"fused": [], "experts_w13": []}
            for num_experts, start, ep, width, (_, rows, hidden) in tp1["fused"]:
                assert (start, ep, rows) == (0, False, 2 * width)
                split = [num_experts, rows // world_size, hidden]
                want["fused"].append([num_experts, 0, False, width // world_size, split])
                want["experts_w13"].append(split)
        assert {k: layout[k] for k in want} == want, r


def test_tp2_and_ep2_equal_tp1(moe_dir, tmp_path):
    qwen3 = moe_dir("qwen3_moe")
    cases = [(qwen3, "native", {}), (qwen3, "transformers", {"enable_expert_parallel": True}),
             # all sparse: no layer holds a dense MLP of the intermediate_size TP=2 does not divide
             (moe_dir("qwen3_moe", intermediate_size=37), "native", {}),
             (moe_dir("qwen2_moe"), "transformers", {}),
             (moe_dir("mixtral"), "transformers", {"enable_expert_parallel": True}),
             (moe_dir("olmoe"), "transformers", {}),
             # fusion=False: q/k/v head-sharded, transformers' full-width q/k RMSNorms -> ShardedRMSNorm
             (moe_dir("olmoe"), "transformers", {"fusion": False})]
    results = _run_ranks(2, cases, tmp_path)
    assert len(results) == len(cases)
    for case, (ranks, want, tp1) in zip(cases, results, strict=True):
        assert [got["tokens"] for got in ranks] == [want, want], case
        _check_split(ranks, tp1, 2, case[2])


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "impl"), [(4, "transformers"), pytest.param(8, "native", marks=pytest.mark.skipif(
    os.environ.get("FXREWRITE_TEST_8_RANKS") != "1", reason="8 processes: ~3-5 min on 2 cores; FXREWRITE_TEST_8_RANKS=1"))])
def test_ep_at_4_and_8_ranks_equals_tp1(moe_dir, tmp_path, world_size, impl):
    """Issue #18's layout in miniature: 8 experts over 4 or 8 ranks (one or two whole experts each)."""
    path = moe_dir("qwen3_moe", num_attention_heads=8, num_key_value_heads=2)
    cases = [(path, impl, {"enable_expert_parallel": True})]
    (ranks, want, tp1), = _run_ranks(world_size, cases, tmp_path)
    assert [got["tokens"] for got in ranks] == [want] * world_size
    _check_split(ranks, tp1, world_size, cases[0][2])


def forbid_worker_start(monkeypatch) -> None:
    """Make starting a worker process fail the test (as the FP8 block-size test does with `create_model_runner`):
    a check moved past `spawn_workers` (into the workers, where it costs a start-up and ends as a WorkerError) raises
    this AssertionError instead of the expected error."""
    import torch.multiprocessing

    import fxrewrite.runtime.worker.dp_executor as dp_executor
    import fxrewrite.runtime.worker.executor as executor
    import fxrewrite.runtime.worker.worker_processes as worker_processes

    def no_workers(*args, **kwargs):
        raise AssertionError("worker processes started before the settings were checked")

    for module in (executor, dp_executor, worker_processes):
        monkeypatch.setattr(module, "spawn_workers", no_workers)
    monkeypatch.setattr(torch.multiprocessing, "start_processes", no_workers)


def test_bad_moe_settings_fail_before_workers_start(moe_dir, tiny_llama_dir, monkeypatch):
    path = moe_dir("qwen3_moe")
    forbid_worker_start(monkeypatch)
    # TP=2 divides the heads and widths, so only the expert-count check stands between this and the workers
    five = moe_dir("qwen3_moe", num_experts=5)
    with pytest.raises(ValueError, match=r"expert count 5 is not divisible by the expert-parallel size 2 "
                                         r"\(tensor_parallel_size=2\)"):
        make_llm(five, "native", tensor_parallel_size=2, enable_expert_parallel=True)
    # TP=3 does not divide the heads either: the expert count is named first
    with pytest.raises(ValueError, match="expert count 8 is not divisible by the expert-parallel size"):
        make_llm(path, "native", tensor_parallel_size=3, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="num_experts_per_tok=9 \\(top-k\\) must be between 1 and the number of "
                                         "experts \\(8\\)"):
        make_llm(path, "native", hf_overrides={"num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="enable_expert_parallel=True but the model has no experts"):
        make_llm(str(tiny_llama_dir), "native", enable_expert_parallel=True)


@pytest.mark.parametrize("ep", [False, True])
def test_shared_expert_width_tp_does_not_divide_fails_before_workers_start(moe_dir, monkeypatch, ep):
    """Qwen2-MoE's shared expert is a dense gated MLP, column-split over TP ranks with or without expert
    parallelism: a width of 51 at TP=2 failed inside the workers ("output_sizes[i]=51 is not divisible")."""
    forbid_worker_start(monkeypatch)
    path = moe_dir("qwen2_moe", shared_expert_intermediate_size=51)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide the shared expert's intermediate "
                                         r"size shared_expert_intermediate_size=51"):
        make_llm(path, "transformers", tensor_parallel_size=2, enable_expert_parallel=ep)


def test_dense_width_checked_where_a_dense_layer_holds_it(moe_dir, monkeypatch):
    """One dense layer (mlp_only_layers) of a width TP=2 does not divide: refused before any worker starts (an
    all-sparse model of that width runs: test_tp2_and_ep2_equal_tp1)."""
    forbid_worker_start(monkeypatch)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide the model's intermediate_size=51"):
        make_llm(moe_dir("qwen3_moe", intermediate_size=51, mlp_only_layers=[0]), "native", tensor_parallel_size=2)


def test_dense_mlp_width_follows_transformers_layer_rules():
    from types import SimpleNamespace

    from fxrewrite.runtime.model_files.dense_mlp import dense_mlp_width

    base = dict(intermediate_size=51, moe_intermediate_size=32, num_experts=8, num_hidden_layers=4)
    assert dense_mlp_width(SimpleNamespace(**base)) is None
    for dense in ({"decoder_sparse_step": 2}, {"mlp_only_layers": [3]}, {"first_k_dense_replace": 1},
                  {"moe_layer_freq": 2}, {"num_experts": 0}):
        assert dense_mlp_width(SimpleNamespace(**{**base, **dense})) == 51, dense
    assert dense_mlp_width(SimpleNamespace(intermediate_size=32, num_local_experts=4)) == 32  # Mixtral: the experts'
    assert dense_mlp_width(SimpleNamespace(intermediate_size=51, moe_intermediate_size=32, n_routed_experts=8,
                                           num_hidden_layers=2, first_k_dense_replace=0)) is None  # DeepSeek
