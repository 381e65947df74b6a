"""Data parallelism on a CPU (gloo): replicas behind one front, and DP attention + expert-parallel MoE.

Greedy tokens (float32) with data_parallel_size 2 equal one engine's: pure replicas (a dense model),
and a Qwen3-MoE whose experts are split over both replicas (native and transformers + fusion), which
exercises the cross-replica MoE collectives and the idle replica's dummy participation (the prompts
are uneven, so one replica runs out of work first).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxrewrite.runtime.engine.data_parallel import DPLLMEngine
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.worker.cuda_graphs import EMULATE_ENV
from fxrewrite.runtime.worker.warmup import WARMUP_ENV
from fxrewrite.runtime.worker.watchdog import LOAD_LOG_ENV, WATCHDOG_ENV
from tests.distributed.constrained import check_constrained
from tests.distributed.tp_ranks import make_llm
from tests.moe.moe_ranks import LAYOUT_DIR_ENV, ep_layout, model_moe_layout, read_dp_layouts, record_dp_layouts
from tests.moe.test_moe_parallel import MOE, forbid_worker_start

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Uneven lengths: the replica with the short requests goes idle while the other still decodes.
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7] * 3]
MAX_TOKENS = [8, 12, 3]


def greedy(llm) -> list[list[int]]:
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
    one = make_llm(str(tiny_qwen3_dir), "native")
    want = greedy(one)
    hook = sys.excepthook
    llm = make_llm(str(tiny_qwen3_dir), "native", data_parallel_size=2)
    try:
        assert sys.excepthook is hook  # torch's "[rank0]: " prefix stays out of the user's tracebacks
        assert greedy(llm) == want
        _check_replicas_used_and_freed(llm)
        check_constrained(llm, one)  # structured outputs, bad words, prompt logprobs
        _check_a_dead_grammar_process_fails_only_its_request(llm.llm_engine)
        assert llm.llm_engine.executor._procs.role == "data-parallel"  # a dead worker's error says so
        workers = list(llm.llm_engine.executor._procs.context.processes)
    finally:
        llm.llm_engine.shutdown()
    # The stop wave reached them: they left their loop and exited, not killed at the shutdown timeout.
    assert [p.exitcode for p in workers] == [0, 0]


def _check_a_dead_grammar_process_fails_only_its_request(engine: DPLLMEngine) -> None:
    """The grammar processes of the replicas killed: the constrained request fails alone, reported by the
    front (`take_failed_requests`), the plain one finishes, and every block is free again."""
    from fxrewrite.runtime.engine.structured_outputs import StructuredOutputsParams

    endless = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "minItems": 1000})
    engine.add_request("plain", [1, 2, 3], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.add_request("constrained", [4, 5], SamplingParams(max_tokens=6, structured_outputs=endless))
    outputs = {o.request_id: o for o in engine.step()}
    grammars = [r._structured for r in engine.engines if r._structured is not None and r._structured.constrained]
    for structured in grammars:
        structured.process._proc.kill()
        structured.process._proc.wait()
    failed = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
        failed.update(engine.take_failed_requests())
    assert grammars and list(failed) == ["constrained"] and "grammar process" in failed["constrained"]
    assert outputs["plain"].finished and len(outputs["plain"].outputs[0].token_ids) == 6
    assert not engine._owner and all(r.block_manager.num_free_blocks == r.block_manager.num_blocks
                                     for r in engine.engines)


LOAD_TIMEOUT_S = 400
"""The whole DP2 + EP run of the load test (two workers load, warm up, capture, generate): about 80 s on
a loaded 2-core machine; a hang of the replicas' collectives ends here instead of stalling the suite."""


def test_dp2_ep_native_with_warmup_and_graphs_equals_one_engine(qwen3_moe_dir, tmp_path):
    """The load sequence the GPU runs, on gloo: kernel warm-up forced on, CUDA graph buckets emulated (one
    forward per bucket at load, as the capture does; decode waves replicas padded to one bucket, the idle
    replica replaying padding rows). Every collective of one replica must meet the other's: a subprocess
    with a timeout, so a deadlock fails with the workers' watchdog lines (their phase and stacks)."""
    one = make_llm(qwen3_moe_dir, "native")
    want, tp1 = greedy(one), model_moe_layout(one.llm_engine.model_runner.model)
    env = {**os.environ, EMULATE_ENV: "1", WARMUP_ENV: "1", WATCHDOG_ENV: "60", LOAD_LOG_ENV: "1",
           LAYOUT_DIR_ENV: str(tmp_path)}
    root = Path(__file__).resolve().parents[2]
    try:
        run = subprocess.run([sys.executable, "-m", "tests.moe.dp_ep_run", qwen3_moe_dir], cwd=root, env=env,
                             capture_output=True, text=True, timeout=LOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"DP2 + EP run hung for {LOAD_TIMEOUT_S} s; the workers' last lines:\n{err[-6000:]}")
    assert run.returncode == 0, run.stderr[-6000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["tokens"] == want
    # the experts are split over the two replicas' workers: worker r holds experts [4r, 4r + 4) of 8, whole
    assert len(tp1["fused"]) == 2 and tp1["fused"][0][0] == 8
    assert out["layouts"] == [ep_layout(tp1, 2, 0), ep_layout(tp1, 2, 1)]
    assert out["buckets"] == 5 and out["routed"] == [2, 1] and out["free"] == [True, True]  # buckets 1..16
    for rank in (0, 1):  # every worker went through the warm-up and the bucket forwards, and finished loading
        log = [line for line in run.stderr.splitlines() if f"DP rank {rank} TP rank 0" in line]
        assert any("kernel warm-up step" in line for line in log), run.stderr[-3000:]
        assert any("bucket 16: warm-up forward" in line for line in log)
        assert any("loaded (5 CUDA graph buckets)" in line for line in log)
    assert "still in" not in run.stderr  # no phase lasted a watchdog period


def test_dp2_ep_transformers_moe_equals_one_engine(qwen3_moe_dir, tmp_path, monkeypatch):
    """Every wave eager (transformers + fusion), the idle replica calling the MoE layers with zero tokens."""
    one = make_llm(qwen3_moe_dir, "transformers")
    want, tp1 = greedy(one), model_moe_layout(one.llm_engine.model_runner.model)
    monkeypatch.setenv(LAYOUT_DIR_ENV, str(tmp_path))
    record_dp_layouts(monkeypatch.setattr)
    llm = make_llm(qwen3_moe_dir, "transformers", data_parallel_size=2, enable_expert_parallel=True)
    try:
        # worker r (replica r) holds experts [4r, 4r + 4) of 8, whole, in each of the 2 fused MoE layers
        assert len(tp1["fused"]) == 2 and tp1["fused"][0][0] == 8
        assert read_dp_layouts(tmp_path, 2) == [ep_layout(tp1, 2, 0), ep_layout(tp1, 2, 1)]
        assert llm.llm_engine.model_runner.model.cuda_graph_buckets == 0
        assert greedy(llm) == want
        _check_replicas_used_and_freed(llm)
        stats = llm.llm_engine.get_stats()
        assert len(stats["data_parallel"]) == 2 and stats["num_running"] == 0
    finally:
        llm.llm_engine.shutdown()


def test_bad_data_parallel_settings_fail_before_workers_start(qwen3_moe_dir, tiny_qwen3_dir, tiny_model_dir,
                                                             monkeypatch):
    forbid_worker_start(monkeypatch)  # each refusal below must come before any worker process starts
    # 6 experts over DP=2 x TP=2: TP=2 divides the heads and widths, so only the expert-count check stands
    # between this and the four workers
    six = str(tiny_model_dir("qwen3_moe", vocab="smollm2", **{**MOE["qwen3_moe"], "num_experts": 6}))
    with pytest.raises(ValueError, match=r"expert count 6 is not divisible by the expert-parallel size 4 "
                                         r"\(data_parallel_size=2 x tensor_parallel_size=2\)"):
        make_llm(six, "native", data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
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
    # fusion=False is no longer refused: transformers' experts modules split over the workers (test_dp_ep_unfused.py)



@pytest.mark.slow
def test_dp2_tp2_ep_moe_equals_one_engine(tiny_model_dir, tmp_path, monkeypatch):
    """4 workers: two replicas of TP=2 (attention heads split inside each), 8 experts over all 4 ranks."""
    path = str(tiny_model_dir("qwen3_moe", vocab="smollm2", num_attention_heads=8, num_key_value_heads=2,
                              **MOE["qwen3_moe"]))
    one = make_llm(path, "native")
    want, tp1 = greedy(one), model_moe_layout(one.llm_engine.model_runner.model)
    monkeypatch.setenv(LAYOUT_DIR_ENV, str(tmp_path))
    record_dp_layouts(monkeypatch.setattr)
    llm = make_llm(path, "native", tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)
    try:
        # worker w = dp_rank * 2 + tp_rank holds experts [2w, 2w + 2) of 8, whole
        assert read_dp_layouts(tmp_path, 4) == [ep_layout(tp1, 4, w) for w in range(4)]
        assert greedy(llm) == want
        _check_replicas_used_and_freed(llm)
    finally:
        llm.llm_engine.shutdown()


def _wave_msg(num_new: list[int]):
    import numpy as np

    from fxrewrite.runtime.worker.step_messages import STEP_FIELDS, StepMessage

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
