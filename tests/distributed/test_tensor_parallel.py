"""Tensor parallelism on a CPU (gloo, 2 ranks): TP=2 greedy tokens equal TP=1, a killed worker ends the
engine with a clear error and leaves no process behind.

Cases: Qwen3 with 1 kv head (fewer kv heads than ranks: replicated) and Llama with 2 (one per rank),
each native and transformers+fusion; GPT-OSS (sinks, experts) with and without fusion. Three run torchrun-style (every rank runs the engine, one spawn
for all), the fourth through `LLM(tensor_parallel_size=2)`'s driver + worker processes, which the
failure test then kills.
"""

import json
import os
import signal
import socket
from pathlib import Path

import psutil
import pytest
import torch.multiprocessing as mp

from tests.distributed.processes import hang, join_or_fail, killed_on_error
from tests.distributed.constrained import check_constrained
from tests.distributed.tp_ranks import (MAX_TOKENS, generate_tokens, make_llm, sampling_params, shard_layout,
                                        spmd_rank)

from fxrewrite.runtime.engine.sampling_params import SamplingParams


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def qwen3_kv1(tiny_model_dir):
    # SmolLM2's tokenizer keeps the vocabulary (and each engine start) small; the layers are Qwen3's.
    return str(tiny_model_dir("qwen3", num_key_value_heads=1, vocab="smollm2"))


@pytest.fixture(scope="module")
def llama_kv2(tiny_llama_dir):
    return str(tiny_llama_dir)  # 4 heads, 2 kv heads (shared with the other engine tests)


@pytest.fixture(scope="module")
def gpt_oss(tiny_model_dir):
    # attention sinks and biases; its tp plan shards no attention projection (heads are sharded all the same)
    return str(tiny_model_dir("gpt_oss", num_local_experts=4, num_experts_per_tok=2, sliding_window=4))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp2_equals_tp1_native_and_fused(qwen3_kv1, llama_kv2, gpt_oss, tmp_path):
    cases = [(qwen3_kv1, "native"), (llama_kv2, "native"), (llama_kv2, "transformers"), (gpt_oss, "transformers"),
             (gpt_oss, "transformers/unfused")]
    out = tmp_path / "tp2.json"
    ctx = mp.start_processes(spmd_rank, args=(_free_port(), cases, str(out)), nprocs=2, join=False,
                             start_method="spawn")
    with killed_on_error(ctx):
        expected = {}  # overlaps the ranks
        for path, impl in cases:
            llm = make_llm(path, impl)
            expected[f"{path}|{impl}"] = {"tokens": generate_tokens(llm), "layout": shard_layout(llm)}
    join_or_fail(ctx, timeout_s=600, what="TP ranks")
    ranks = [json.loads((tmp_path / f"tp2.json.{rank}").read_text()) for rank in (0, 1)]
    for rank, got in enumerate(ranks):
        assert list(got) == list(expected)
        for (path, impl), (key, want) in zip(cases, expected.items(), strict=True):
            assert got[key]["tokens"] == want["tokens"], (rank, key)
            assert got[key]["layout"] == _tp2_layout(want["layout"], rank, path), (rank, key)
    assert all(len(c) == MAX_TOKENS for case in expected.values() for t in case["tokens"] for c in t)


def _tp2_layout(tp1: dict, rank: int, path: str) -> dict:
    """What TP rank `rank` of 2 must hold, from TP=1's `shard_layout`: half the query heads (and half the kv heads,
    all of them when there are fewer kv heads than ranks), half of o_proj's input columns, half the MLP width, half of
    GPT-OSS's experts (whole ones: transformers' own experts module, not fused) and half the vocabulary rows (rank r's
    half starting at r * V/2)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    q_rows = cfg["num_attention_heads"] * head_dim
    (rows, cols), kv_rows = tp1["qkv"], tp1["qkv"][0] - q_rows
    assert kv_rows in (0, 2 * cfg["num_key_value_heads"] * head_dim)  # fused [q|k|v], or q_proj alone (unfused)
    local_kv = kv_rows // 2 if cfg["num_key_value_heads"] >= 2 else kv_rows  # one kv head: replicated
    vocab = tp1["lm_head"][0]
    want = {"world_size": 2, "tp_size": 2, "tp_rank": rank, "qkv": [q_rows // 2 + local_kv, cols],
            "o_proj": [tp1["o_proj"][0], tp1["o_proj"][1] // 2], "gate_up": None, "down": None, "experts": None,
            "lm_head": [vocab // 2, rank * vocab // 2]}
    if tp1["gate_up"] is not None:  # a dense MLP (GPT-OSS has experts)
        want["gate_up"] = [tp1["gate_up"][0] // 2, tp1["gate_up"][1]]
        want["down"] = [tp1["down"][0], tp1["down"][1] // 2]
    if tp1["experts"] is not None:  # [E, H, 2I]: E/2 experts on each rank
        want["experts"] = [tp1["experts"][0] // 2, *tp1["experts"][1:]]
    assert tp1["world_size"] == tp1["tp_size"] == 1 and tp1["lm_head"][1] == 0
    return want


def test_a_hung_rank_fails_the_test_within_its_deadline():
    ctx = mp.start_processes(hang, args=(600,), nprocs=2, join=False, start_method="spawn")
    with pytest.raises(pytest.fail.Exception, match="did not finish within 2 s"):
        join_or_fail(ctx, timeout_s=2)
    assert not any(p.is_alive() for p in ctx.processes)


def test_tp2_preemption_under_async_scheduling_equals_tp1(qwen3_kv1, monkeypatch):
    """12 KV blocks of 4 tokens for ~17 blocks of work: sequences are preempted and recomputed under new
    block tables while steps are in flight (the driver sends only table deltas, a new table whole).
    Steps go over gloo here (the fallback); the other driver tests use shared memory."""
    small = {"kv_cache_memory_bytes": 12 << 10}  # 1 KiB a block: 2 layers x (K, V) x 4 tokens x 1 head x 16 x 4 B
    monkeypatch.setenv("FXREWRITE_STEP_TRANSPORT", "gloo")
    tp2 = make_llm(qwen3_kv1, "native", tensor_parallel_size=2, **small)
    try:
        assert tp2.llm_engine.model_runner.step_transport == "gloo"
        assert tp2.llm_engine.async_scheduling and tp2.llm_engine.block_manager.num_blocks == 12
        tokens = generate_tokens(tp2)
        assert tp2.llm_engine.get_stats()["num_preemptions"] > 0
    finally:
        tp2.llm_engine.model_runner.shutdown()
    assert tokens == generate_tokens(make_llm(qwen3_kv1, "native", **small))


@pytest.fixture(scope="module")
def tp2_llm(qwen3_kv1):
    llm = make_llm(qwen3_kv1, "transformers", tensor_parallel_size=2)
    yield llm
    llm.llm_engine.model_runner.shutdown()


def test_llm_tp2_workers_equal_tp1_transformers_fused(tp2_llm, qwen3_kv1):
    """Driver + 2 worker processes. Greedy tokens equal TP=1's; seeded sampling (its generators live
    in rank 0's sequence mirrors) repeats itself. Seeded tokens are not compared with TP=1: this
    random model's distributions are flat, and a near-tie (log-probs equal to 1e-5) flips on the
    all-reduce's rounding."""
    assert tp2_llm.llm_engine.model_runner.step_transport == "shm"
    one = make_llm(qwen3_kv1, "transformers")
    assert generate_tokens(tp2_llm) == generate_tokens(one)
    check_constrained(tp2_llm, one)  # structured outputs, bad words, prompt logprobs
    seeded = generate_tokens(tp2_llm, sampling_params())
    assert seeded == generate_tokens(tp2_llm, sampling_params())
    assert [len(c) for t in seeded for c in t] == [MAX_TOKENS] * 4


def test_ctrl_c_during_generate_leaves_the_workers_serving(tp2_llm, python_sigint):
    """fresh-user find: a Ctrl-C (KeyboardInterrupt) in `LLM.generate` at TP=2 shut the workers down ('the
    tensor-parallel workers are shut down (KeyboardInterrupt: )' on every later call), where one process serves on:
    the interrupted step exchange now completes first, the call's requests are aborted, and the engine serves on."""
    import _thread
    import threading

    want = generate_tokens(tp2_llm)
    long = SamplingParams(temperature=0, max_tokens=5000, ignore_eos=True)
    for delay in (1.0, 1.3):
        threading.Timer(delay, _thread.interrupt_main).start()
        with pytest.raises(KeyboardInterrupt):
            tp2_llm.generate([[1, 2, 3]] * 3, long, use_tqdm=False)
        assert not tp2_llm.llm_engine.has_unfinished_requests()
        assert generate_tokens(tp2_llm) == want  # every KV block free again, too


def test_killed_worker_ends_engine_with_clear_error(tp2_llm):
    from fxrewrite.runtime.worker.executor import WorkerError

    engine = tp2_llm.llm_engine
    pids = engine.model_runner.worker_pids()
    engine.add_request("long", list(range(5, 25)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerError, match="SIGKILL"):
        while engine.has_unfinished_requests():
            engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    assert not [c for c in psutil.Process().children(recursive=True) if c.pid in pids]
    with pytest.raises(WorkerError, match="shut down"):
        tp2_llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(WorkerError, match="SIGKILL"):
        engine.check_health()  # what the server's /health reports


def test_a_rank_refusing_the_checkpoint_is_one_user_error_and_no_process_is_left(qwen3_kv1, tmp_path):
    """fresh-user report: at tensor_parallel_size=2 a checkpoint missing a tensor was a rank's traceback and a
    gloo "connection closed" error; the workers now hand their UserInputError to the driver, which raises it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from fxrewrite.errors import UserInputError
    from fxrewrite.runtime.llm import LLM

    folder = shutil.copytree(qwen3_kv1, tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    with pytest.raises(UserInputError, match=rf"^the checkpoint in {folder} is missing 1 parameter\(s\): "
                                             r"model.layers.0.mlp.up_proj.weight$"):
        LLM(str(folder), tensor_parallel_size=2, dtype="float32", block_size=4)
    left = [c.cmdline() for c in psutil.Process().children(recursive=True) if c.pid not in before]
    assert [c for c in left if "resource_tracker" not in " ".join(c)] == []  # spawn's tracker lives on


def test_a_head_tied_to_an_unsharded_embedding_stays_whole_and_refusals_keep_their_kind(tiny_model_dir):
    """BioGPT's LM head is tied to its scaled word embedding, a class the sharding leaves whole: the head stays whole
    too (before, it became a vocab shard of its own and the checkpoint 'missed' output_projection.weight). Its
    attention has no plan to shard it by, so the ranks refuse the model: the driver raises that as the
    UnsupportedModelError (a NotImplementedError) it was, not a plain UserInputError (found by arch_sweep at TP=2)."""
    import torch
    from transformers import AutoConfig

    from fxrewrite.errors import UnsupportedModelError
    from fxrewrite.runtime.llm import LLM
    from fxrewrite.runtime.models.transformers_backend import TransformersForCausalLM
    from fxrewrite.sharding import shard_model

    folder = tiny_model_dir("biogpt")
    hf = TransformersForCausalLM.from_config(AutoConfig.from_pretrained(folder), torch.float32, False).hf_model
    shard_model(hf, 0, 2)
    assert hf.output_projection.weight is hf.biogpt.embed_tokens.weight
    with pytest.raises(UnsupportedModelError, match="BioGptForCausalLM: layer 0 attends with all 4 key/value heads"):
        LLM(str(folder), model_impl="transformers", tensor_parallel_size=2, dtype="float32", block_size=4)


def test_attention_reshaping_by_its_own_head_count_runs_sharded(tiny_model_dir):
    """OPT's attention reshapes by its own `num_heads` (``view(bsz, -1, self.num_heads, head_dim)``): each rank's
    module now holds the rank's count, and TP=2 gives transformers' greedy tokens (before: a view error at load).
    StableLM with per-head q / k LayerNorms (one module per head) is refused: a rank would pair its heads with the
    first heads' norms (its row partner is not proven: the norm module is none known to act head by head). Found by
    arch_sweep at TP=2."""
    from fxrewrite.benchmarks import arch_sweep
    from fxrewrite.errors import UnsupportedModelError

    folder = tiny_model_dir("opt", initializer_range=0.2)
    ids = arch_sweep.prompts(49152)
    expected = arch_sweep.oracle(folder, ids)
    got = arch_sweep.engine_run(folder, ids, True, {"tensor_parallel_size": 2})
    assert arch_sweep.judge(expected, got)["status"] == "equal"
    with pytest.raises(UnsupportedModelError, match=r"self_attn.qkv_proj: .* no proven row partner .*q_layernorm "
                                                    r"\(StableLmLayerNormPerHead\) is not a norm over one head"):
        arch_sweep.engine_run(tiny_model_dir("stablelm", qk_layernorm=True), ids, True, {"tensor_parallel_size": 2})
