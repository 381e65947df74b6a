"""Data parallel x expert parallel with transformers' own experts modules (the ones the rewrite leaves unfused:
GPT-OSS's clamped-SwiGLU experts, any MoE with fusion=False), on a CPU (gloo).

Each of the dp x tp workers holds E/(dp x tp) whole experts of such a module (`sharding_moe.ExpertsAcrossReplicas`:
the replicas' inputs all-gathered, the outputs reduce-scattered, as `fxrewrite.layers.moe_dp` does for FusedMoE);
greedy tokens (float32) equal one engine's, through waves where the replicas compute different token counts and
waves where one replica is idle (eager, and with CUDA graph buckets emulated). Module level: every worker's
partial output summed is the whole module's.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from fxrewrite.runtime.worker.cuda_graphs import EMULATE_ENV
from tests.distributed.processes import join_or_fail
from tests.distributed.tp_ranks import make_llm
from tests.moe.moe_ranks import (
    EXPERTS_DP_CALLS, EXPERTS_DP_CASES, LAYOUT_DIR_ENV, experts_dp_rank, model_moe_layout, read_dp_layouts,
    record_dp_layouts)
from tests.moe.test_data_parallel import _check_replicas_used_and_freed, greedy
from tests.moe.test_moe_parallel import MOE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4)  # test_tensor_parallel.py's folder
ENGINES = {  # (arch, folder, engine kwargs, CUDA graph buckets emulated: decode waves padded to one bucket)
    "gpt_oss": ("gpt_oss", GPT_OSS, {"max_num_seqs": 16}, True),  # fusion on: its experts stay transformers'
    "qwen3_moe_unfused": ("qwen3_moe", {"vocab": "smollm2", **MOE["qwen3_moe"]}, {"fusion": False}, False)}


def _record_waves(monkeypatch) -> list[list[int]]:
    """Every wave's token count per replica, as the driver sends it (`dp_worker.wave_token_counts`)."""
    from fxrewrite.runtime.worker.dp_executor import DPExecutor
    from fxrewrite.runtime.worker.dp_worker import wave_token_counts

    waves, flush = [], DPExecutor.flush

    def recording_flush(self):
        if any(s is not None for s in self._wave_steps):
            waves.append(wave_token_counts(self._wave))
        flush(self)

    monkeypatch.setattr(DPExecutor, "flush", recording_flush)
    return waves


def _dp_engine_matches_one(path: str, kwargs: dict, num_workers: int, tmp_path, monkeypatch, graphs=False) -> None:
    if graphs:  # buckets 1..16, one forward each at load with uniform row counts; idle replicas replay one
        monkeypatch.setenv(EMULATE_ENV, "1")
    one = make_llm(path, "transformers", **kwargs)
    want, tp1 = greedy(one), model_moe_layout(one.llm_engine.model_runner.model)
    assert tp1["fused"] == [] and len(tp1["experts_w13"]) == 2  # both layers' experts are transformers'
    monkeypatch.setenv(LAYOUT_DIR_ENV, str(tmp_path))
    record_dp_layouts(monkeypatch.setattr)
    waves = _record_waves(monkeypatch)
    llm = make_llm(path, "transformers", data_parallel_size=2, enable_expert_parallel=True,
                   tensor_parallel_size=num_workers // 2, **kwargs)
    try:
        split = [[e // num_workers, *rest] for e, *rest in tp1["experts_w13"]]
        assert read_dp_layouts(tmp_path, num_workers) == [{"fused": [], "experts_w13": split}] * num_workers
        assert llm.llm_engine.model_runner.model.cuda_graph_buckets == (5 if graphs else 0)
        assert greedy(llm) == want
        _check_replicas_used_and_freed(llm)
    finally:
        llm.llm_engine.shutdown()
    assert any(0 < a != b > 0 for a, b in waves), waves  # both replicas busy, different token counts
    assert any(min(w) == 0 < max(w) for w in waves), waves  # one replica idle (zero-row experts calls)


@pytest.mark.parametrize("case", sorted(ENGINES))
def test_dp2_ep_unfused_experts_split_and_equal_one_engine(case, tiny_model_dir, tmp_path, monkeypatch):
    """Worker r (replica r, tp 1) holds experts [rE/2, (r+1)E/2) of each layer's transformers experts module."""
    arch, build, kwargs, graphs = ENGINES[case]
    _dp_engine_matches_one(str(tiny_model_dir(arch, **build)), kwargs, 2, tmp_path, monkeypatch, graphs)


@pytest.mark.slow  # 4 worker processes: about 20 s on 2 cores
def test_dp2_tp2_ep_unfused_experts_equal_one_engine(tiny_model_dir, tmp_path, monkeypatch):
    """4 workers: GPT-OSS's 4 experts, one whole expert per worker; attention heads split inside each replica."""
    _dp_engine_matches_one(str(tiny_model_dir("gpt_oss", **GPT_OSS)), {}, 4, tmp_path, monkeypatch)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_workers_partial_outputs_sum_to_the_whole_module(tmp_path):
    """2 workers (DP=2 x EP, tp 1) of GPT-OSS's and Qwen2-MoE's experts modules through transformers' experts
    implementations: worker r holds rows [rE/2, (r+1)E/2) of every parameter (full_shape and weight sync still
    see all E); each replica gets the whole module's output on its own rows, for uneven counts (5 / 3), an idle
    replica (4 / 0) and CUDA-graph-style uniform counts (2 / 2); the workers' partial outputs on the gathered rows
    (each replica's padded to the longest) sum to the whole module's output, padding rows to zero."""
    out = tmp_path / "experts_dp"
    ctx = mp.start_processes(experts_dp_rank, args=(_free_port(), str(out)), nprocs=2, join=False,
                             start_method="spawn")
    join_or_fail(ctx, timeout_s=300, what="data-parallel experts ranks")
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    assert list(ranks[0]) == [f"{f}/{i}" for f, i in EXPERTS_DP_CASES]
    for name in ranks[0]:
        whole = ranks[0][name]["local"]["whole"]
        num_experts = next(iter(whole.values())).shape[0]
        for r, got in enumerate(rank[name] for rank in ranks):
            local, half = got["local"], num_experts // 2
            assert (local["style"], local["num_experts"], local["global_num_experts"]) == ("experts_whole", half,
                                                                                        num_experts), name
            for pname, param in local["params"].items():
                assert torch.equal(param, whole[pname][r * half:(r + 1) * half]), (name, pname)
                assert local["full_shapes"][pname] == tuple(whole[pname].shape)
        for (counts, how), *calls in zip(EXPERTS_DP_CALLS, *(rank[name]["calls"] for rank in ranks), strict=True):
            longest = max(counts)
            summed = calls[0]["partial"] + calls[1]["partial"]
            assert summed.shape == (2 * longest, 32)
            for call in calls:  # each worker computes only its experts' share of every replica's rows
                assert call["partial"].any() and not torch.allclose(call["partial"], summed)
            for r, call in enumerate(calls):
                mine = summed[r * longest: r * longest + counts[r]]
                if counts[r] == 0:
                    assert call["out"] is None
                    continue
                torch.testing.assert_close(call["out"], call["want"], rtol=1e-5, atol=1e-6, msg=f"{name} {how}")
                torch.testing.assert_close(mine, call["want"], rtol=1e-5, atol=1e-6)
                assert not summed[r * longest + counts[r]: (r + 1) * longest].any()  # padding rows: zero
