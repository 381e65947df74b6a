"""Pipeline parallelism on a CPU (gloo): the decoder layers split into stages, greedy and seeded-sampled
tokens equal to one process at PP=2 (native) and TP=2 x PP=2 (transformers + fusion) with several
requests at once and two micro-batches in flight; each stage's KV cache holds only its layers; sleep and
wake_up act on (and report) every stage; a pipeline larger than the layer count is refused before any
worker starts."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.distributed.constrained import check_constrained
from tests.distributed.tp_ranks import generate_tokens, make_llm, sampling_params

from fxrewrite.runtime.worker.kv_cache import bytes_per_block
from fxrewrite.runtime.worker.pipeline import PipelineStage, PPMissingLayer, stage_layers


@pytest.fixture(scope="module")
def qwen3_3layers(tiny_model_dir):
    # 3 layers: stage 0 holds two, stage 1 one (an uneven split); one kv head (replicated at TP=2).
    return str(tiny_model_dir("qwen3", num_hidden_layers=3, num_key_value_heads=1, vocab="smollm2"))


def test_stage_layers_split_evenly_earlier_stages_take_the_rest():
    assert [stage_layers(3, 2, r) for r in range(2)] == [(0, 2), (2, 3)]
    assert [stage_layers(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [stage_layers(5, 5, r) for r in range(5)] == [(i, i + 1) for i in range(5)]


def test_layer_partition_env_sets_the_stage_boundaries(monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "33,31")
    assert [stage_layers(64, 2, r) for r in range(2)] == [(0, 33), (33, 64)]
    for bad in ("32,31", "64,0", "a,b", "20,20,24"):
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", bad)
        with pytest.raises(ValueError, match=f"VLLM_PP_LAYER_PARTITION='{bad}': expected 2 positive layer counts"):
            stage_layers(64, 2, 0)


def test_pipeline_larger_than_the_layer_count_is_refused(qwen3_3layers):
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 is larger than the model's num_hidden_layers=3"):
        make_llm(qwen3_3layers, "native", pipeline_parallel_size=4)


def test_bad_pipeline_size_argument():
    from fxrewrite.runtime.engine_config import EngineConfig

    with pytest.raises(ValueError, match="pipeline_parallel_size=0 must be a positive integer"):
        EngineConfig(pipeline_parallel_size=0)


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_stage_split_of_a_transformers_model(qwen3_3layers, pp_rank):
    from transformers import AutoConfig

    from fxrewrite.runtime.models.transformers_backend import TransformersForCausalLM

    model = TransformersForCausalLM.from_config(AutoConfig.from_pretrained(qwen3_3layers), torch.float32, True)
    stage = PipelineStage(pp_rank, 2, (1, 2), None)
    dropped = stage.apply(model, 3)
    stage.allocate(8, 64, torch.float32, torch.device("cpu"))
    base = model.hf_model.base_model
    kept = [type(m) is not PPMissingLayer for m in base.layers]
    x = torch.randn(1, 4, 64)
    if pp_rank == 0:
        assert dropped == ["model.layers.2."] and kept == [True, True, False]
        assert base.norm(x) is x  # the final norm belongs to the last stage
    else:
        assert dropped == ["model.layers.0.", "model.layers.1."] and kept == [False, False, True]
        stage.buffer.normal_()
        assert torch.equal(base.embed_tokens(torch.zeros(1, 3, dtype=torch.long)), stage.buffer[:3].view(1, 3, 64))


def test_pp2_native_equals_one_process(qwen3_3layers, monkeypatch):
    one = make_llm(qwen3_3layers, "native")
    want = generate_tokens(one, sampling_params())
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,2")  # not the default split (workers inherit it)
    hook = sys.excepthook
    llm = make_llm(qwen3_3layers, "native", pipeline_parallel_size=2)
    try:
        assert sys.excepthook is hook  # torch's "[rank0]: " prefix stays out of the user's tracebacks
        assert generate_tokens(llm, sampling_params()) == want
        queue = llm.llm_engine.micro_batches
        assert queue.depth == 2 and queue.max_in_flight == 2  # stage 0 got batch i + 1 before i returned
        check_constrained(llm, one)  # structured outputs, bad words, prompt logprobs
        # Each stage caches only its layers: stage 0's two of three bound the shared block count.
        mc = one.llm_engine.model_config
        per_layer = bytes_per_block(mc, 4, torch.float32, (0, 1))
        assert one.llm_engine.block_manager.num_blocks == (1 << 22) // (3 * per_layer)
        assert llm.llm_engine.block_manager.num_blocks == (1 << 22) // (2 * per_layer)
    finally:
        llm.llm_engine.model_runner.shutdown()


def test_tp2_pp2_transformers_fused_equals_one_process(qwen3_3layers, tiny_model_dir):
    """TP=2 x PP=2 (four ranks) greedy tokens equal one process's; then a weight sync from another checkpoint (each
    rank takes its stage's layers and its TP slice) gives that checkpoint's one-process tokens."""
    from transformers import AutoModelForCausalLM

    want = generate_tokens(make_llm(qwen3_3layers, "transformers"))
    other = str(tiny_model_dir("qwen3", num_hidden_layers=3, num_key_value_heads=1, vocab="smollm2", seed=1))
    want_other = generate_tokens(make_llm(other, "transformers"))
    llm = make_llm(qwen3_3layers, "transformers", tensor_parallel_size=2, pipeline_parallel_size=2)
    try:
        assert generate_tokens(llm) == want
        assert llm.llm_engine.micro_batches.max_in_flight == 2
        llm.load_weights(AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32))
        assert generate_tokens(llm) == want_other != want
    finally:
        llm.llm_engine.model_runner.shutdown()


def test_pp2_load_weights_updates_every_stage_and_bad_input_changes_none(qwen3_3layers, tiny_model_dir):
    """Each stage holds only its layers: a full model's sync failed ("tensor 'model.layers.0...' matches no
    parameter": the last stage refused the first stage's tensors), and an error found by another stage than the
    last (which alone replies) was lost while that stage's plan went unused."""
    from transformers import AutoModelForCausalLM

    other = str(tiny_model_dir("qwen3", num_hidden_layers=3, num_key_value_heads=1, vocab="smollm2", seed=1))
    want = generate_tokens(make_llm(other, "native"))
    llm = make_llm(qwen3_3layers, "native", pipeline_parallel_size=2)
    try:
        before = generate_tokens(llm)
        source = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32)
        bad = [(n, t[:-1] if n == "model.layers.0.mlp.down_proj.weight" else t) for n, t in source.state_dict().items()]
        with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight' has shape \(63, 128\)"):
            llm.load_weights(bad)  # stage 0's tensor: stage 1 (the replying one) must not copy its own either
        assert generate_tokens(llm) == before != want
        names = llm.load_weights(source)
        assert {"model.layers.0.mlp.down_proj.weight", "model.layers.2.mlp.down_proj.weight"} <= names
        assert generate_tokens(llm) == want
    finally:
        llm.llm_engine.model_runner.shutdown()


def test_pp2_sleep_and_wake_up_act_on_every_stage(qwen3_3layers):
    """Every stage holds weights and KV cache: the sleep status the driver reports combines every rank's
    (it was the last stage's alone), each rank frees and restores its own memory, and the tokens after
    waking (level 1; level 2 + load_weights) equal those before."""
    from transformers import AutoModelForCausalLM

    llm = make_llm(qwen3_3layers, "native", pipeline_parallel_size=2)
    try:
        runner = llm.llm_engine.model_runner
        before = generate_tokens(llm)
        awake = runner.rank_statuses()
        assert [(r["rank"], r["stage"], r["tp_rank"], r["sleep"]) for r in awake] == [(1, 0, 0, None), (2, 1, 0, None)]
        held = [r["memory"] for r in awake]
        assert all(m["kv_cache"] > 0 and m["weights"] > 0 for m in held)
        llm.sleep(level=1)
        assert llm.llm_engine.is_sleeping()
        asleep = runner.rank_statuses()
        assert [r["sleep"] for r in asleep] == [(("kv_cache",), False)] * 2  # CPU: weights are host memory
        assert [r["memory"] for r in asleep] == [{"kv_cache": 0, "weights": m["weights"]} for m in held]
        with pytest.raises(RuntimeError, match="asleep"):
            generate_tokens(llm)
        llm.wake_up()
        assert not llm.llm_engine.is_sleeping() and [r["memory"] for r in runner.rank_statuses()] == held
        assert generate_tokens(llm) == before
        llm.sleep(level=2)
        assert [r["memory"] for r in runner.rank_statuses()] == [{"kv_cache": 0, "weights": 0}] * 2
        llm.wake_up()
        assert [r["sleep"] for r in runner.rank_statuses()] == [((), True)] * 2
        with pytest.raises(RuntimeError, match="load_weights"):
            generate_tokens(llm)
        llm.load_weights(AutoModelForCausalLM.from_pretrained(qwen3_3layers, dtype=torch.float32))
        assert [r["sleep"] for r in runner.rank_statuses()] == [None, None] and not llm.llm_engine.is_sleeping()
        assert generate_tokens(llm) == before
    finally:
        llm.llm_engine.model_runner.shutdown()


def test_ranks_that_disagree_on_sleep_are_an_error_naming_them():
    from fxrewrite.runtime.worker.sleep_mode import combine_rank_statuses

    def report(rank, status):
        return {"rank": rank, "stage": rank - 1, "tp_rank": 0, "sleep": status}

    asleep = (("kv_cache",), False)
    assert combine_rank_statuses([]) is None
    assert combine_rank_statuses([report(1, None), report(2, None)]) is None
    assert combine_rank_statuses([report(1, asleep), report(2, asleep)]) == asleep
    with pytest.raises(RuntimeError, match=r"disagree \(awake on rank 1 \(PP stage 0, TP rank 0\); asleep "
                                           r"\(kv_cache freed\) on rank 2 \(PP stage 1, TP rank 0\)\)"):
        combine_rank_statuses([report(1, None), report(2, asleep)])


def test_a_killed_stage_is_named_as_a_pipeline_stage(qwen3_3layers):
    """fresh-user find: a PP=2 worker's death said 'tensor-parallel worker failed ... (process i is TP rank i ...)',
    though TP was 1 and process 1 was pipeline stage 1."""
    import os
    import signal

    import psutil

    from fxrewrite.runtime.engine.sampling_params import SamplingParams
    from fxrewrite.runtime.worker.executor import WorkerError

    llm = make_llm(qwen3_3layers, "native", pipeline_parallel_size=2)
    engine = llm.llm_engine
    pids = engine.model_runner.worker_pids()
    engine.add_request("long", list(range(5, 25)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    engine.step()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerError, match=r"^pipeline-parallel worker failed .*\(process i is PP stage i; pids .*"
                                          r"process 1 terminated with signal SIGKILL"):
        while engine.has_unfinished_requests():
            engine.step()
    with pytest.raises(WorkerError, match="^the pipeline-parallel workers are shut down"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE] == []


def test_tp_x_pp_worker_errors_name_stage_and_tp_rank():
    from fxrewrite.runtime.worker.executor import _worker_roles

    assert _worker_roles(2, 1) == ("tensor-parallel", "process i is TP rank i")
    assert _worker_roles(2, 2) == ("tensor/pipeline-parallel", "process i is PP stage i // 2, TP rank i % 2")
