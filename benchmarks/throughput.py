"""Throughput workload (nano-vllm's `bench.py`): 256 requests, prompt and output lengths uniform in
[100, 1024], random token ids below 10000, seed 0, ignore_eos; a warm-up batch, one timed run.

Greedy instead of nano-vllm's temperature 0.6 (see `temperature`). Figure: output tokens per second over the timed run (all requests added at once).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace

from fxrewrite.benchmarks.common import run_requests
from fxrewrite.benchmarks.decode_window import DecodeWindow
from fxrewrite.benchmarks.step_profile import step_profile
from fxrewrite.benchmarks.step_timing import gc_pauses
from fxrewrite.kernels.triton_utils import watch_jit_compiles
from fxrewrite.runtime.engine.sampling_params import SamplingParams

WARMUP_PROMPTS = 32


@dataclass
class ThroughputWorkload:
    num_prompts: int = 256
    min_len: int = 100
    max_input_len: int = 1024
    max_output_len: int = 1024
    max_token_id: int = 10000
    seed: int = 0
    decode_window_steps: int = 0
    """> 0: the headline is the full-batch decode window of this many steps (`DecodeWindow`), and each arm
    stops once it is measured; 0: nano-vllm's figure (the window is still reported, over 8 steps)."""
    temperature: float = 0.0
    """nano-vllm samples at 0.6; greedy here, as in every recorded run so far (the sampler drew its
    noise on the CPU until 2026-11-29; it now draws it on the device, so 0.6 is fair to try next)."""

    def describe(self) -> dict:
        return {"kind": "throughput", **asdict(self), "warmup_prompts": min(WARMUP_PROMPTS, self.num_prompts)}

    def generate(self) -> tuple[list[list[int]], list[int]]:
        """(prompts as token ids, output lengths), deterministic in `seed`."""
        rng = random.Random(self.seed)
        prompts = [[rng.randint(0, self.max_token_id) for _ in range(rng.randint(self.min_len, self.max_input_len))]
                   for _ in range(self.num_prompts)]
        output_lens = [rng.randint(self.min_len, self.max_output_len) for _ in range(self.num_prompts)]
        return prompts, output_lens

    @property
    def max_model_len(self) -> int:
        return self.max_input_len + self.max_output_len


def run_throughput(llm, workload: ThroughputWorkload, time_limit_s: float | None = None) -> dict:
    """Warm up, then time the whole workload through `llm.llm_engine`.

    The warm-up is WARMUP_PROMPTS requests of the same length distribution under another seed (no
    prefix-cache hit for the timed run), 8 output tokens each: it runs full, chunked and mixed prefill
    steps, so the Triton kernels' specializations are compiled before the clock starts, not inside the
    first arm's timed run."""
    engine = llm.llm_engine
    prompts, output_lens = workload.generate()
    warm = replace(workload, num_prompts=min(WARMUP_PROMPTS, workload.num_prompts), seed=workload.seed + 1)
    warm_prompts, _ = warm.generate()
    run_requests(engine, warm_prompts, [SamplingParams(max_tokens=8, ignore_eos=True)] * len(warm_prompts),
                 desc="warm-up")
    params = [SamplingParams(temperature=workload.temperature, max_tokens=n, ignore_eos=True, seed=None)
              for n in output_lens]
    window = DecodeWindow(workload.decode_window_steps or 8)
    with step_profile(engine.model_runner) as profile, watch_jit_compiles() as compiled, gc_pauses() as collections:
        stats = run_requests(engine, prompts, params, time_limit_s, desc="timed run", window=window,
                             stop_after_window=workload.decode_window_steps > 0)
    headline = {"headline_key": "decode_window.output_tokens_per_s"} if workload.decode_window_steps else {}
    return {
        **headline,
        "decode_window": window.result(),
        "triton_jit_in_timed_run": compiled,  # should be empty: each entry is a JIT stall inside the timing
        "gc_pauses": collections,  # Python's cyclic-GC passes inside the timing (their count and total pause)
        # host_other: the host's time outside launches and waits (scheduling, outputs). Until 2026-12-06 it was
        # named host_not_hidden, but the device may run a launched step meanwhile: gpu_idle says what was not hidden
        "step_profile_s": {**profile, "host_other": round(stats.elapsed_s - profile["launch"] - profile["wait"], 3)},
        "output_tokens": stats.output_tokens,
        "prompt_tokens": stats.prompt_tokens,
        "elapsed_s": round(stats.elapsed_s, 6),  # microseconds: the ratios are computed from it
        "output_tokens_per_s": round(stats.output_tokens / stats.elapsed_s, 1),
        "total_tokens_per_s": round((stats.output_tokens + stats.prompt_tokens) / stats.elapsed_s, 1),
        "num_finished": stats.num_finished,
        "num_requests": stats.num_requests,
        "truncated": stats.truncated,
        "num_preemptions": engine.get_stats().get("num_preemptions"),
    }
