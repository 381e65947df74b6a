"""The harness's request loop (`run_requests`): an engine in this process runs the requests as `LLM.generate` does
(one output each, when it finishes), and the progress the figures need, read from the sequences, is what per-step
outputs would have said: the same first-token steps, finish steps, token counts and decode window."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.benchmarks.common import bench_model_dir, load_bench_config, make_llm, run_requests
from fxrewrite.benchmarks.decode_window import DecodeWindow
from fxrewrite.runtime.engine.sampling_params import SamplingParams


class _OutputsOnly:
    """The engine seen through its outputs alone, as run_requests sees a data-parallel engine."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        if name == "requests":
            raise AttributeError(name)
        return getattr(self._engine, name)


class _Front(_OutputsOnly):
    """A data-parallel front over one replica: the requests' records are the replica's."""

    def __init__(self, engine):
        super().__init__(engine)
        self.engines, self.kinds = [engine], set()

    def add_request(self, *args, **kwargs):
        self.kinds.add(kwargs.get("final_only", False))
        return self._engine.add_request(*args, **kwargs)


@pytest.fixture(scope="module")
def engine():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    spec = load_bench_config("tiny")
    spec["config"] = {**spec["config"], "num_hidden_layers": 1}
    llm = make_llm("native", bench_model_dir(spec), device="cpu", max_num_seqs=4, kv_cache_memory_bytes=1 << 22,
                   max_num_batched_tokens=16)  # chunked prefill: steps that sample nothing for some requests
    yield llm.llm_engine
    torch.set_num_threads(threads)


def _steps(stats, times: dict) -> dict:
    return {rid: stats.step_end_s.index(t) for rid, t in times.items()}


def test_final_only_run_reports_the_progress_per_step_outputs_report(engine):
    prompts = [[5 + i] * n for i, n in enumerate((3, 9, 14))]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 11, 4)]
    runs = {}
    front = _Front(engine)
    for name, target in (("final_only", engine), ("outputs", _OutputsOnly(engine)), ("front", front)):
        window = DecodeWindow(2)
        stats = run_requests(target, prompts, params, window=window)
        runs[name] = (stats, window.result())
    (ours, our_window), (ref, ref_window), (dp, dp_window) = runs["final_only"], runs["outputs"], runs["front"]
    assert front.kinds == {True} and dp.output_tokens == ours.output_tokens and dp_window == {**dp_window, **{
        k: our_window[k] for k in ("steps", "batch", "output_tokens")}}
    assert _steps(dp, dp.first_token_s) == _steps(ours, ours.first_token_s)
    assert len(ours.step_end_s) == len(ref.step_end_s)
    assert ours.output_tokens == ref.output_tokens == 21 and ours.num_finished == 3
    assert _steps(ours, ours.first_token_s) == _steps(ref, ref.first_token_s)
    assert _steps(ours, ours.finish_s) == _steps(ref, ref.finish_s)
    assert our_window["steps"] == ref_window["steps"] > 0
    assert our_window["output_tokens"] == ref_window["output_tokens"] and our_window["batch"] == 3


def test_a_run_stopped_after_its_window_counts_the_unfinished_requests_tokens(engine):
    prompts = [[7] * 4, [8] * 5]
    params = [SamplingParams(max_tokens=30, ignore_eos=True)] * 2
    totals = []
    for target in (engine, _OutputsOnly(engine)):
        stats = run_requests(target, prompts, params, window=DecodeWindow(3), stop_after_window=True)
        assert stats.truncated and stats.num_finished == 0
        totals.append(stats.output_tokens)
    assert totals[0] == totals[1] > 0
    assert not engine.has_unfinished_requests()


def test_latency_rows_of_cut_runs(engine, monkeypatch):
    """A batch cut before its first token is an error row, not a crash; a cut run's decode rate is over the steps
    it ran, not over output_len - 1 of them."""
    from types import SimpleNamespace

    from fxrewrite.benchmarks import latency

    llm = SimpleNamespace(llm_engine=engine)
    workload = latency.LatencyWorkload(batch_sizes=[2], prompt_len=6, output_len=40)
    row = latency.run_latency(llm, workload, time_limit_s=0.0)["batch_2"]
    assert row["truncated"] and "had no output token" in row["error"]
    full = latency.run_latency(llm, latency.LatencyWorkload(batch_sizes=[2], prompt_len=6, output_len=6))["batch_2"]
    real = engine.step  # slow each step down so that a time limit cuts the run after a few of them

    def slow_step():
        import time

        time.sleep(0.02)
        return real()

    monkeypatch.setattr(engine, "step", slow_step)
    cut = latency.run_latency(llm, workload, time_limit_s=0.2)["batch_2"]
    assert cut["truncated"] and not full["truncated"]
    assert cut["decode_ms_per_step"] >= 20  # each counted step slept 20 ms; over 39 steps it would read ~5 ms
