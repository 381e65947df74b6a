"""Latency workload: batch 1 and 8, a 128-token prompt each, 128 greedy output tokens (ignore_eos).

Figures per batch size: time to first token (the prefill step), decode time per step and tokens/s per
sequence; with CUDA, the memory roofline of a decode step (weight bytes over the measured copy
bandwidth) and the fraction of it reached (roofline time / measured step time).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

import torch

from fxrewrite.benchmarks.common import copy_bandwidth_bytes_per_s, engine_weight_bytes, replay_ms, run_requests
from fxrewrite.benchmarks.step_timing import decode_step_summary, gc_pauses
from fxrewrite.kernels.triton_utils import watch_jit_compiles
from fxrewrite.runtime.engine.sampling_params import SamplingParams


@dataclass
class LatencyWorkload:
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    prompt_len: int = 128
    output_len: int = 128
    seed: int = 0

    def describe(self) -> dict:
        return {"kind": "latency", **asdict(self)}

    @property
    def max_model_len(self) -> int:
        return self.prompt_len + self.output_len

    def prompts(self, batch_size: int, seed_offset: int = 0) -> list[list[int]]:
        rng = random.Random(self.seed + batch_size + seed_offset)
        return [[rng.randint(0, 10000) for _ in range(self.prompt_len)] for _ in range(batch_size)]


def run_latency(llm, workload: LatencyWorkload, time_limit_s: float | None = None) -> dict:
    """Per batch size: ttft_ms, decode_ms_per_step, decode_tokens_per_s (per sequence), roofline."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)
    max_seqs = engine.scheduler.max_num_seqs
    skipped = {f"batch_{bs}": {"skipped": f"batch size {bs} is more than max_num_seqs={max_seqs}"}
               for bs in workload.batch_sizes if bs > max_seqs}
    batch_sizes = [bs for bs in workload.batch_sizes if bs <= max_seqs]
    if not batch_sizes:
        raise ValueError(f"every latency batch size {workload.batch_sizes} is more than max_num_seqs={max_seqs}")
    for bs in batch_sizes:  # warm-up at every batch size (Triton JIT of its prefill), other prompts
        run_requests(engine, workload.prompts(bs, seed_offset=1000), [SamplingParams(max_tokens=8, ignore_eos=True)] * bs,
                     desc=f"warm-up batch {bs}")
    bandwidth = copy_bandwidth_bytes_per_s()
    nbytes = engine_weight_bytes(engine)
    result = {"weight_bytes": nbytes, "copy_bandwidth_GBps": bandwidth and round(bandwidth / 1e9, 1), **skipped}
    for bs in batch_sizes:
        with watch_jit_compiles() as compiled, gc_pauses() as collections:
            stats = run_requests(engine, workload.prompts(bs), [params] * bs, time_limit_s, desc=f"batch {bs}")
        row, decode_s = _timed_row(stats, bs, workload.output_len, time_limit_s)
        if decode_s is None:
            result[f"batch_{bs}"] = row
            continue
        # JIT builds should be none (each is a stall inside the timing); GC passes inside the timed run
        row.update(triton_jit_in_timed_run=compiled, gc_in_timed_run=collections)
        step_bytes = engine_weight_bytes(engine, batch_size=bs)  # a MoE step reads only the routed experts
        if step_bytes != nbytes:
            row["step_weight_bytes"] = step_bytes
        if bandwidth:
            roofline_s = step_bytes / bandwidth
            row["roofline_ms_per_step"] = round(roofline_s * 1e3, 3)
            row["roofline_fraction"] = round(roofline_s / decode_s, 3)
        result[f"batch_{bs}"] = row
    for bs in batch_sizes:  # GPU time alone, to split a step into model time and engine overhead
        gpu_ms = graph_replay_ms(engine.model_runner, bs)
        row = result[f"batch_{bs}"]
        if gpu_ms is not None and "decode_ms_per_step" in row:  # not a batch whose run never got a token
            row["graph_replay_ms"] = round(gpu_ms, 3)
            # whether the replay timed includes the LM head and greedy sampler (runtime/worker/greedy_head.py)
            graphs = engine.model_runner.graph_runner
            row["graph_has_lm_head"] = graphs.bucket(bs) in graphs.heads
            row.update(graph_forward_fields(graphs, graphs.bucket(bs)))
            row["engine_overhead_ms_per_step"] = round(row["decode_ms_per_step"] - gpu_ms, 3)
            if bandwidth:
                row["graph_roofline_fraction"] = round(row["roofline_ms_per_step"] / gpu_ms, 3)
    return result


def _timed_row(stats, bs: int, output_len: int, time_limit_s: float | None) -> tuple[dict, float | None]:
    """One batch size's timing from `run_requests`' stats and its unrounded seconds per decode step, or
    ({"truncated", "error"}, None) when the time limit left no figure: a request without its first token, or no decode step after the last first token (the time from it to
    the abort, ~0.1 ms, was reported as one decode step: 10,000 tokens/s on a CPU that decodes 250)."""
    if len(stats.first_token_s) < bs:
        return {"truncated": True, "error": f"{bs - len(stats.first_token_s)} of {bs} requests had no output token "
                                            f"within the time limit ({time_limit_s} s)"}, None
    ttft = max(stats.first_token_s.values())
    end = max(stats.finish_s.values(), default=stats.elapsed_s)
    # a truncated run decoded the steps that ended after the last first token, not output_len - 1 of them
    steps = sum(1 for t in stats.step_end_s if ttft < t <= end) if stats.truncated else output_len - 1
    if steps < 1 and stats.truncated:
        return {"truncated": True, "ttft_ms": round(ttft * 1e3, 2),
                "error": f"no decode step after the first token within the time limit ({time_limit_s} s)"}, None
    decode_s = (end - ttft) / max(1, steps)
    return {"ttft_ms": round(ttft * 1e3, 2), "decode_ms_per_step": round(decode_s * 1e3, 3),
            "decode_tokens_per_s_per_seq": round(1.0 / decode_s, 1), "decode_tokens_per_s": round(bs / decode_s, 1),
            "truncated": stats.truncated,
            # a mean above the graph replay: per-step host work (median up) or a few stalls (long steps, GC)
            **decode_step_summary(stats.step_end_s, ttft, end)}, decode_s


def graph_forward_fields(graphs, bucket: int) -> dict:
    """What bucket `bucket`'s decode graph holds: {"graph_forward": "model" | "compiled" | "eager"}, plus under
    `-O` > 0 the capture-time replay times the choice was made on ("graph_choice_replay_ms")."""
    fields = {"graph_forward": graphs.forward_kind.get(bucket)}
    if bucket in graphs.replay_ms:
        fields["graph_choice_replay_ms"] = {kind: round(ms, 4) for kind, ms in graphs.replay_ms[bucket].items()}
    return fields


def graph_replay_ms(runner, batch_size: int, iters: int = 50) -> float | None:
    """Mean GPU time of one replay of the decode graph for `batch_size` (CUDA events); None without
    graphs. Every row's KV write is disabled first (slot -1), so replaying touches no cache block."""
    graphs = getattr(runner, "graph_runner", None)
    if graphs is None or not graphs.graphs:
        return None
    bucket = min((s for s in graphs.sizes if s >= batch_size), default=None)
    if bucket is None:  # larger than every captured bucket: such a step runs eagerly
        return None
    with torch.inference_mode():  # under -O 3 the graphs' buffers are inference tensors (cuda_graphs.py)
        graphs.slot_mapping.fill_(-1)
    return replay_ms(graphs.graphs[bucket], iters, warmup=3)
