"""CUDA graphs: bucket sizes (CPU) and, on a GPU, replay of every bucket against the eager forward."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.runtime.worker.cuda_graphs import capture_sizes


def test_capture_sizes_are_nano_vllm_buckets():
    assert capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]  # the top size itself, so 17..20 get a graph
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(4096)[-1] == 1024 and capture_sizes(1024)[35:] == [512, 576, 640, 704, 768, 832, 896, 960, 1024]
    assert capture_sizes(600)[-2:] == [576, 600]


def test_static_buffer_replay_logic_on_cpu(tiny_qwen3_dir):
    """run()'s copy-in, padding and bucket choice, with each 'graph' replaying the model eagerly
    over the static buffers (what a captured graph does), against the plain eager forward."""
    from tests.gpu.conftest import decode_batch
    from fxrewrite.runtime.worker.cuda_graphs import CUDAGraphRunner
    from fxrewrite.runtime.worker.forward_context import forward_context
    from fxrewrite.runtime.llm import LLM

    llm = LLM(str(tiny_qwen3_dir), model_impl="native", kv_cache_memory_bytes=1 << 22, max_model_len=512)
    runner = llm.llm_engine.model_runner
    mc = llm.llm_engine.model_config
    graphs = CUDAGraphRunner(runner.model, runner.kv_caches, max_num_seqs=20, max_model_len=512, block_size=16,
                             hidden_size=mc.hidden_size, dtype=mc.dtype, device=runner.device)

    class Replay:
        def __init__(self, bs):
            self.bs = bs

        def replay(self):
            with forward_context(graphs._metadata(self.bs)):
                graphs.outputs[: self.bs] = runner.model(graphs.input_ids[: self.bs], graphs.positions[: self.bs])

    graphs.graphs = {bs: Replay(bs) for bs in graphs.sizes}
    for n in (1, 3, 16, 17, 20, 5):
        ids, pos, meta = decode_batch(runner, n, max_len=200, seed=n)
        assert graphs.can_run(n, meta)
        with torch.inference_mode():
            with forward_context(meta):
                eager = runner.model(ids, pos)
            replay = graphs.run(ids, pos, meta)
        torch.testing.assert_close(replay, eager, rtol=1e-4, atol=1e-5)
        bs = min(s for s in graphs.sizes if s >= n)
        assert (graphs.slot_mapping[n:bs] == -1).all()  # padding rows of the bucket write no KV


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("impl,fusion", [("native", True), ("transformers", True), ("transformers", False)])
def test_every_bucket_replay_matches_eager(make_llm, impl, fusion):
    from tests.gpu.conftest import decode_batch
    from fxrewrite.runtime.worker.forward_context import forward_context

    llm = make_llm(model_impl=impl, fusion=fusion, max_num_seqs=40, compilation_config=0)
    runner = llm.llm_engine.model_runner
    graphs = runner.graph_runner
    assert graphs is not None, "CUDA graphs were not captured"
    assert sorted(graphs.graphs) == capture_sizes(40)
    for n in [*capture_sizes(40), 3, 33]:  # every bucket, and sizes that round up
        ids, pos, meta = decode_batch(runner, n, seed=n)
        assert graphs.can_run(n, meta)
        with torch.inference_mode():
            with forward_context(meta):
                eager = runner.model(ids, pos).clone()
            replay = graphs.run(ids, pos, meta).clone()
        assert replay.shape == eager.shape
        assert _close(replay, eager) < 1e-3, f"bucket for {n} sequences differs from eager"


def _record_can_run(graphs) -> list[tuple[int, bool]]:
    """Wrap graphs.can_run: the list gets (max_query_len, answer) for every step the engine runs."""
    calls, real = [], graphs.can_run

    def can_run(num_tokens, metadata):
        ok = real(num_tokens, metadata)
        calls.append((metadata.max_query_len, ok))
        return ok

    graphs.can_run = can_run
    return calls


def _prompts():
    return [[int(t) for t in torch.randint(0, 10000, (n,), generator=torch.Generator().manual_seed(n))]
            for n in (5, 17, 40)]


def test_prefill_steps_run_eager_on_cpu(tiny_qwen3_dir):
    """The dispatch of `execute_model` with a graph runner whose 'graphs' replay eagerly over the static
    buffers: prefill steps never go to the graphs, decode steps do, and the tokens equal the plain engine's."""
    from fxrewrite.runtime.engine.sampling_params import SamplingParams
    from fxrewrite.runtime.llm import LLM
    from fxrewrite.runtime.worker.cuda_graphs import CUDAGraphRunner
    from fxrewrite.runtime.worker.forward_context import forward_context

    llm = LLM(str(tiny_qwen3_dir), model_impl="native", kv_cache_memory_bytes=1 << 22, max_model_len=512)
    runner, mc = llm.llm_engine.model_runner, llm.llm_engine.model_config
    graphs = CUDAGraphRunner(runner.model, runner.kv_caches, max_num_seqs=4, max_model_len=512, block_size=16,
                             hidden_size=mc.hidden_size, dtype=mc.dtype, device=runner.device)
    replayed = []

    class Replay:
        def __init__(self, bs):
            self.bs = bs

        def replay(self):
            replayed.append(self.bs)
            with forward_context(graphs._metadata(self.bs)):
                graphs.outputs[: self.bs] = runner.model(graphs.input_ids[: self.bs], graphs.positions[: self.bs])

    graphs.graphs = {bs: Replay(bs) for bs in graphs.sizes}
    runner.graph_runner = graphs
    calls = _record_can_run(graphs)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
    prefill, decode = [ok for q, ok in calls if q > 1], [ok for q, ok in calls if q == 1]
    assert prefill and not any(prefill), calls
    assert decode and all(decode) and len(replayed) == len(decode)
    runner.graph_runner = None  # the plain engine
    assert got == [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]


@pytest.mark.gpu
def test_prefill_and_eager_fall_back(make_llm):
    """With CUDA graphs captured, steps holding prompt tokens run the eager forward and decode steps
    replay graphs; greedy tokens equal enforce_eager's, which captures no graph and compiles nothing."""
    from fxrewrite.runtime.engine.sampling_params import SamplingParams

    llm = make_llm(model_impl="native", compilation_config=0)
    graphs = llm.llm_engine.model_runner.graph_runner
    assert graphs is not None, "CUDA graphs were not captured"
    calls = _record_can_run(graphs)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    fast = llm.generate(_prompts(), params, use_tqdm=False)
    prefill, decode = [ok for q, ok in calls if q > 1], [ok for q, ok in calls if q == 1]
    assert prefill and not any(prefill), calls
    assert decode and all(decode), calls
    eager = make_llm(model_impl="native", enforce_eager=True)
    assert eager.llm_engine.model_runner.graph_runner is None
    assert not getattr(eager.llm_engine.model_runner.model, "_fxrewrite_compiled", False)
    slow = eager.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in slow]


@pytest.mark.gpu
def test_generate_with_graphs_matches_eager(make_llm):
    from fxrewrite.runtime.engine.sampling_params import SamplingParams

    prompts = [[int(t) for t in torch.randint(0, 10000, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (5, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    fast = make_llm(model_impl="native", compilation_config=0).generate(prompts, params, use_tqdm=False)
    slow = make_llm(model_impl="native", enforce_eager=True).generate(prompts, params, use_tqdm=False)
    for a, b in zip(fast, slow):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.gpu
def test_kv_cache_sized_by_memory_profiling(small_model_dir):
    import gc

    from fxrewrite.runtime.llm import LLM

    total = torch.cuda.mem_get_info()[1]
    llm = LLM(str(small_model_dir), load_format="dummy", model_impl="native", gpu_memory_utilization=0.3,
              max_model_len=1024, compilation_config=0)
    runner = llm.llm_engine.model_runner
    assert runner.num_blocks > 1000
    assert torch.cuda.memory_reserved() < 0.32 * total
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()


def test_a_failing_bucket_is_skipped_not_all_graphs(monkeypatch, caplog):
    """One bucket that cannot be captured (twice) is left out with a warning naming it; its batches go
    to the next larger bucket; only when no bucket captures does capture() raise (then decode is eager)."""
    from fxrewrite.runtime.worker import cuda_graphs
    from fxrewrite.runtime.worker.cuda_graphs import CUDAGraphRunner

    runner = CUDAGraphRunner.__new__(CUDAGraphRunner)
    runner.sizes, runner.graphs, runner.pool, runner.head_max_batch = [1, 2, 4, 8], {}, None, 4
    runner.forward_kind, runner.replay_ms = {}, {}
    tries = []

    def capture_one(bs, head):
        tries.append((bs, head))
        if bs == 2:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        runner.graphs[bs] = f"graph{bs}"

    monkeypatch.setattr(runner, "_capture_one", capture_one)
    monkeypatch.setattr(cuda_graphs.torch.cuda, "synchronize", lambda: None)
    with caplog.at_level("WARNING"):
        runner.capture()
    # the retry leaves the LM head out of the graph (buckets <= head_max_batch try it first)
    assert tries == [(8, False), (4, True), (2, True), (2, False), (1, True)] and runner.sizes == [1, 4, 8] and runner.max_batch_size == 8
    assert "batch size 2 not captured" in caplog.text and "CUBLAS_STATUS_NOT_SUPPORTED" in caplog.text

    def never(bs, head):
        raise RuntimeError(f"no graph at {bs}")

    runner.sizes, runner.graphs = [1, 2], {}
    monkeypatch.setattr(runner, "_capture_one", never)
    with pytest.raises(RuntimeError, match="no graph at 2"):
        runner.capture()


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_graph_head_equals_the_eager_head(make_llm, monkeypatch, impl):
    """The LM head and greedy sampler in the decode graphs (FXREWRITE_GRAPH_LOGITS=on, buckets <= 16) against
    them run eagerly after the graph (off), async scheduling: every step's tokens and sampled logprobs bitwise
    equal at batch sizes that are buckets (1, 4, 16: the head's GEMV runs at the same number of rows)."""
    from fxrewrite.runtime.engine.sampling_params import SamplingParams
    from fxrewrite.runtime.worker import greedy_head
    from tests.runtime.test_greedy_head import record_samples

    seen = record_samples(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    runs = {}
    for value in ("off", "on"):
        monkeypatch.setenv(greedy_head.ENV, value)
        llm = make_llm(model_impl=impl, max_num_seqs=24, compilation_config=0)
        heads = sorted(llm.llm_engine.model_runner.graph_runner.heads)
        assert heads == ([1, 2, 4, 8, 16] if value == "on" else [])
        seen.clear()
        batches = [[[int(t) for t in torch.randint(0, 10000, (5 + 3 * i,), generator=torch.Generator().manual_seed(i))]
                    for i in range(n)] for n in (1, 4, 16)]
        tokens = [[o.outputs[0].token_ids for o in llm.generate(b, params, use_tqdm=False)] for b in batches]
        runs[value] = (tokens, list(seen))
        del llm
    assert runs["on"][0] == runs["off"][0]
    assert runs["on"][1] == runs["off"][1] and len(runs["on"][1]) >= 30


@pytest.mark.gpu
def test_greedy_kernel_gives_the_reference_tokens(make_llm, monkeypatch):
    """FXREWRITE_GREEDY_KERNEL=on (the two-launch greedy sampler in the graphs' head and in the eager sampler) against
    off (the reference ops): the same tokens at batch 1, 4, 16 (graph heads) and 40 (eager), every step's sampled
    log-prob within float32 rounding."""
    from fxrewrite.kernels import greedy_sample
    from fxrewrite.runtime.engine.sampling_params import SamplingParams
    from tests.runtime.test_greedy_head import record_samples

    seen = record_samples(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    runs = {}
    for value in ("off", "on"):
        monkeypatch.setenv(greedy_sample.ENV, value)
        llm = make_llm(model_impl="native", max_num_seqs=48, compilation_config=0)
        seen.clear()
        batches = [[[int(t) for t in torch.randint(0, 10000, (5 + 3 * i,), generator=torch.Generator().manual_seed(i))]
                    for i in range(n)] for n in (1, 4, 16, 40)]
        tokens = [[o.outputs[0].token_ids for o in llm.generate(b, params, use_tqdm=False)] for b in batches]
        runs[value] = (tokens, list(seen))
        del llm
    assert runs["on"][0] == runs["off"][0]
    on = [lp for step in runs["on"][1] for _, lp in step]
    off = [lp for step in runs["off"][1] for _, lp in step]
    assert len(on) == len(off) >= 40
    torch.testing.assert_close(torch.tensor(on), torch.tensor(off), rtol=1e-5, atol=1e-5)
