"""Data parallelism on a CPU (gloo): replicas behind one front, and DP attention + expert-parallel MoE.

Greedy tokens (float32) with data_parallel_size 2 equal one engine's: pure replicas (a dense model),
and a Qwen3-MoE whose experts are split over both replicas (native and transformers + fusion), which
exercises the cross-replica MoE collectives and the idle replica's dummy participation (the prompts
are uneven, so one replica runs out of work first).
"""

from __future__ import annotations

import pytest
import torch

from fxrewrite.runtime.engine.data_parallel import DPLLMEngine
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.worker.cuda_graphs import EMULATE_ENV
from tests.distributed.tp_ranks import make_llm
from tests.moe.test_moe_parallel import MOE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Uneven lengths: the replica with the short requests goes idle while the other still decodes.
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7] * 3]
MAX_TOKENS = [8, 12, 3]


def _greedy(llm) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _check_replicas_used_and_freed(llm) -> None:
    engine = llm.llm_engine
    assert isinstance(engine, DPLLMEngine) and len(engine.engines) == 2
    for replica in engine.engines:
        bm = replica.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    assert engine.num_requests_routed == [2, 1]  # loads 0/0 -> r0, 4/0 -> r1, 4/4 -> r0


@pytest.fixture(scope="module")
def qwen3_moe_dir(tiny_model_dir):
    return str(tiny_model_dir("qwen3_moe", vocab="smollm2", **MOE["qwen3_moe"]))


def test_dp2_dense_replicas_equal_one_engine(tiny_qwen3_dir):
    want = _greedy(make_llm(str(tiny_qwen3_dir), "native"))
    llm = make_llm(str(tiny_qwen3_dir), "native", data_parallel_size=2)
    try:
        assert _greedy(llm) == want
        _check_replicas_used_and_freed(llm)
        workers = list(llm.llm_engine.executor._procs.context.processes)
    finally:
        llm.llm_engine.shutdown()
    # The stop wave reached them: they left their loop and exited, not killed at the shutdown timeout.
    assert [p.exitcode for p in workers] == [0, 0]


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_dp2_ep_moe_equals_one_engine(qwen3_moe_dir, impl, monkeypatch):
    """native: decode waves through the CUDA-graph bucket protocol (buckets emulated eagerly on the CPU:
    replicas padded to one bucket, MoE collectives of uniform size, the idle replica replaying padding
    rows); transformers: every wave eager, the idle replica calling the MoE layers with zero tokens."""
    want = _greedy(make_llm(qwen3_moe_dir, impl))
    if impl == "native":
        monkeypatch.setenv(EMULATE_ENV, "1")  # the spawned workers inherit it
    llm = make_llm(qwen3_moe_dir, impl, data_parallel_size=2, enable_expert_parallel=True)
    try:
        assert (llm.llm_engine.model_runner.model.cuda_graph_buckets > 0) == (impl == "native")
        assert _greedy(llm) == want
        _check_replicas_used_and_freed(llm)
        stats = llm.llm_engine.get_stats()
        assert len(stats["data_parallel"]) == 2 and stats["num_running"] == 0
    finally:
        llm.llm_engine.shutdown()


def test_bad_data_parallel_settings_fail_before_workers_start(qwen3_moe_dir, tiny_qwen3_dir):
    with pytest.raises(ValueError, match="data_parallel_size=0 must be a positive integer"):
        make_llm(qwen3_moe_dir, "native", data_parallel_size=0)
    with pytest.raises(ValueError, match=r"expert count 8 is not divisible by the expert-parallel size 6 "
                                         r"\(data_parallel_size=2 x tensor_parallel_size=3\)"):
        make_llm(qwen3_moe_dir, "native", data_parallel_size=2, tensor_parallel_size=3, enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 \(top-k\) must be between 1 and the number of "
                                         r"experts \(8\)"):
        make_llm(qwen3_moe_dir, "native", data_parallel_size=2, hf_overrides={"num_experts_per_tok": 9})
    dp = torch.cuda.device_count() + 2
    with pytest.raises(ValueError, match=rf"data_parallel_size={dp} x tensor_parallel_size=1 x "
                                         rf"pipeline_parallel_size=1 needs {dp} GPUs, found {dp - 2}"):
        LLM(str(tiny_qwen3_dir), data_parallel_size=dp, device="cuda")
    with pytest.raises(ValueError, match="with pipeline_parallel_size=2 is not supported"):
        make_llm(str(tiny_qwen3_dir), "native", data_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="needs fused MoE layers: fusion=False"):
        make_llm(qwen3_moe_dir, "transformers", data_parallel_size=2, enable_expert_parallel=True, fusion=False)



@pytest.mark.slow
def test_dp2_tp2_ep_moe_equals_one_engine(tiny_model_dir):
    """4 workers: two replicas of TP=2 (attention heads split inside each), 8 experts over all 4 ranks."""
    path = str(tiny_model_dir("qwen3_moe", vocab="smollm2", num_attention_heads=8, num_key_value_heads=2,
                              **MOE["qwen3_moe"]))
    want = _greedy(make_llm(path, "native"))
    llm = make_llm(path, "native", tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)
    try:
        assert _greedy(llm) == want
        _check_replicas_used_and_freed(llm)
    finally:
        llm.llm_engine.shutdown()


def _wave_msg(num_new: list[int]):
    import numpy as np

    from fxrewrite.runtime.worker.worker import STEP_FIELDS, StepMessage

    steps = np.zeros((len(num_new), len(STEP_FIELDS)), dtype=np.int64)
    steps[:, STEP_FIELDS.index("num_new_tokens")] = num_new
    return StepMessage([], [], steps, np.zeros(0, np.int64), np.zeros(0, np.int64))


def test_wave_bucket_pads_every_replica_to_one_decode_graph():
    """DP x EP decode waves replay one CUDA graph bucket on every replica (idle ones too); a prefill
    anywhere, or more sequences than the largest bucket, runs the whole wave eagerly (0)."""
    from fxrewrite.runtime.worker.cuda_graphs import CUDAGraphRunner
    from fxrewrite.runtime.worker.dp_worker import wave_bucket, wave_token_counts

    graphs = CUDAGraphRunner(None, None, max_num_seqs=40, max_model_len=64, block_size=16, hidden_size=4,
                             dtype=torch.float32, device=torch.device("cpu"))
    graphs.graphs = dict.fromkeys(graphs.sizes)  # sizes 1, 2, 4, 8, 16, 32, 40 (capture needs a GPU)

    def bucket(*wave):
        return wave_bucket(list(wave), wave_token_counts(list(wave)), graphs)

    assert bucket(_wave_msg([1] * 3), None) == 4  # replica 1 idle: it replays bucket 4 on padding rows
    assert bucket(_wave_msg([1] * 3), _wave_msg([1] * 9)) == 16
    assert bucket(_wave_msg([1] * 40), _wave_msg([1])) == 40
    assert bucket(_wave_msg([1] * 41), None) == 0
    assert bucket(_wave_msg([1, 5]), _wave_msg([1])) == 0  # a prefill chunk: eager everywhere
    assert bucket(None, None) == 0
    graphs.step_bucket = 0
    meta = type("M", (), {"max_query_len": 1, "seq_lens": torch.ones(2), "max_seq_len": 8})()
    assert not graphs.can_run(2, meta)
    graphs.step_bucket = 16
    assert graphs.can_run(2, meta) and graphs.bucket(max(2, graphs.step_bucket)) == 16
