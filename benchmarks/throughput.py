"""Throughput workload (nano-vllm's `bench.py`): 256 requests, prompt and output lengths uniform in
[100, 1024], random token ids below 10000, seed 0, ignore_eos; one warm-up request, one timed run.

Greedy instead of nano-vllm's temperature 0.6 (see `temperature`). Figure: output tokens per second over the timed run (all requests added at once).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass


@dataclass
class ThroughputWorkload:
    num_prompts: int = 256
    min_len: int = 100
    max_input_len: int = 1024
    max_output_len: int = 1024
    max_token_id: int = 10000
    seed: int = 0
    temperature: float = 0.0
    """nano-vllm samples at 0.6; greedy here, as in every recorded run so far (the sampler drew its
    noise on the CPU until 2026-11-29; it now draws it on the device, so 0.6 is fair to try next)."""

    def describe(self) -> dict:
        return {"kind": "throughput", **asdict(self)}

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
    """Warm up with one short request, then time the whole workload through `llm.llm_engine`."""
    from benchmarks.common import run_requests, step_profile
    from fxrewrite.runtime.sampling_params import SamplingParams

    engine = llm.llm_engine
    prompts, output_lens = workload.generate()
    run_requests(engine, [prompts[0][:16]], [SamplingParams(max_tokens=4, ignore_eos=True)])
    params = [SamplingParams(temperature=workload.temperature, max_tokens=n, ignore_eos=True, seed=None)
              for n in output_lens]
    with step_profile(engine.model_runner) as profile:
        stats = run_requests(engine, prompts, params, time_limit_s)
    return {
        "step_profile_s": {**profile, "host_not_hidden": round(stats.elapsed_s - profile["launch"] - profile["wait"], 3)},
        "output_tokens": stats.output_tokens,
        "prompt_tokens": stats.prompt_tokens,
        "elapsed_s": round(stats.elapsed_s, 3),
        "output_tokens_per_s": round(stats.output_tokens / stats.elapsed_s, 1),
        "total_tokens_per_s": round((stats.output_tokens + stats.prompt_tokens) / stats.elapsed_s, 1),
        "num_finished": stats.num_finished,
        "num_requests": stats.num_requests,
        "truncated": stats.truncated,
        "num_preemptions": engine.get_stats().get("num_preemptions"),
    }
