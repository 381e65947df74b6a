"""Long-context workload: one prompt of 32k, 64k and 128k tokens (32000, 64000, 128000) under YaRN
factor 4 (original 32768 positions, so max_model_len 131072), 32 greedy output tokens each.

Figures per length: time to first token (chunked prefill), decode tokens/s, whether every logprob
was finite (no NaN/inf), and the check that the logits of the prompt's 4096-token prefix, computed as
the first chunk of the long prefill, match a short run of that prefix alone (max |diff|, argmax).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field

import torch

from fxrewrite.benchmarks.common import run_requests
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.worker.forward_context import AttentionMetadata, forward_context


@dataclass
class LongWorkload:
    prompt_lens: list[int] = field(default_factory=lambda: [32000, 64000, 128000])
    output_len: int = 32
    prefix_len: int = 4096
    yarn_factor: float = 4.0
    original_max_position_embeddings: int = 32768
    seed: int = 0

    def describe(self) -> dict:
        return {"kind": "long", **asdict(self)}

    @property
    def max_model_len(self) -> int:
        return int(self.yarn_factor * self.original_max_position_embeddings)

    def hf_overrides(self, rope_theta: float) -> dict:
        return {"rope_parameters": {
            "rope_type": "yarn", "factor": self.yarn_factor, "rope_theta": rope_theta,
            "original_max_position_embeddings": self.original_max_position_embeddings}}

    def prompt(self, length: int) -> list[int]:
        rng = random.Random(self.seed + length)
        return [rng.randint(0, 10000) for _ in range(length)]


@torch.inference_mode()
def _last_logits(runner, tokens: list[int], chunk: int, want: int) -> torch.Tensor:
    """Logits [V] at index `want` of `tokens`, prefilled in chunks of `chunk` tokens through the
    runner's model into KV blocks 0.. (the engine must be idle and run without prefix caching)."""
    device, bs = runner.device, runner.block_size
    n = want + 1
    table = torch.arange(-(-n // bs), dtype=torch.int32, device=device)[None, :]
    hidden = None
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, end, device=device), block_tables=table,
            seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=device),
            max_query_len=end - start, max_seq_len=end, kv_caches=runner.kv_caches,
        )
        ids = torch.tensor(tokens[start:end], device=device)
        with forward_context(meta):
            hidden = runner.model(ids, torch.arange(start, end, device=device))
    return runner.model.compute_logits(hidden[-1:]).float()[0]


def run_long(llm, workload: LongWorkload, time_limit_s: float | None = None) -> dict:
    engine = llm.llm_engine
    result = {}
    params = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True, logprobs=1)
    for length in workload.prompt_lens:
        prompt = workload.prompt(length)
        outputs = []
        engine_step = engine.step

        def step():  # keep the last outputs to read their logprobs
            outs = engine_step()
            outputs.extend(outs)
            return outs

        engine.step = step
        try:
            stats = run_requests(engine, [prompt], [params], time_limit_s, desc=f"prompt {length}")
        finally:
            engine.step = engine_step
        result[f"prompt_{length}"] = _prompt_row(stats, outputs, length, workload.output_len, time_limit_s)
    rows = [result[f"prompt_{n}"] for n in workload.prompt_lens]
    result["truncated"] = any(row["truncated"] for row in rows)  # the table's note
    result["prefix_check"] = prefix_check(llm, workload)
    longest = result.get(f"prompt_{max(workload.prompt_lens)}", {})
    result["decode_tokens_per_s"] = longest.get("decode_tokens_per_s")
    return result


def _prompt_row(stats, outputs: list, length: int, output_len: int, time_limit_s: float | None) -> dict:
    """One prompt's figures (seconds, tokens/s). A run the time limit cut has no final output: its decode rate is of
    the tokens it made (None with fewer than 2, and ttft None without a first token, with an "error" saying so),
    and `all_logprobs_finite` is None (not checked), not False (which reads as NaN logprobs)."""
    final = [o for o in outputs if o.finished]
    logprobs = final[0].outputs[0].logprobs if final else []
    ttft = stats.first_token_s.get("bench-0")
    decoded = (stats.output_tokens - 1) if stats.truncated else output_len - 1
    decode_s = stats.elapsed_s - ttft if ttft is not None else 0.0
    row = {"ttft_s": round(ttft, 3) if ttft is not None else None,
           "prefill_tokens_per_s": round(length / ttft, 1) if ttft else None,
           "decode_tokens_per_s": round(decoded / decode_s, 1) if decoded > 0 and decode_s > 0 else None,
           "all_logprobs_finite": (all(math.isfinite(lp.logprob) for step in logprobs for lp in step.values())
                                   and bool(logprobs)) if final else None,
           "truncated": stats.truncated}
    if ttft is None:
        row["error"] = f"no output token within the time limit ({time_limit_s} s)"
    return row


def prefix_check(llm, workload: LongWorkload) -> dict:
    """Logits at the prefix's last token: first chunk of the longest prompt vs the prefix alone."""
    runner = llm.llm_engine.model_runner
    if not hasattr(runner, "kv_caches"):
        return {"skipped": "the prefix check reads logits in this process; the model runs in tensor-parallel workers"}
    tokens = workload.prompt(max(workload.prompt_lens))
    chunk = llm.llm_engine.config.max_num_batched_tokens
    want = workload.prefix_len - 1
    in_chunk = _prefix_logits_in_chunk(runner, tokens, chunk, want)
    short = _last_logits(runner, tokens[: workload.prefix_len], workload.prefix_len, want)
    diff = (in_chunk - short).abs().max().item()
    return {
        "max_abs_diff": round(diff, 5),
        "argmax_equal": bool(in_chunk.argmax() == short.argmax()),
        "finite": bool(torch.isfinite(in_chunk).all() and torch.isfinite(short).all()),
        "match": bool(diff < 0.1 * max(1.0, short.abs().max().item()) and in_chunk.argmax() == short.argmax()),
    }


@torch.inference_mode()
def _prefix_logits_in_chunk(runner, tokens: list[int], chunk: int, want: int) -> torch.Tensor:
    """Logits at index `want` when the first `chunk` tokens of `tokens` run as one prefill chunk."""
    device, bs = runner.device, runner.block_size
    n = min(chunk, len(tokens))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        block_tables=torch.arange(-(-n // bs), dtype=torch.int32, device=device)[None, :],
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        max_query_len=n, max_seq_len=n, kv_caches=runner.kv_caches,
    )
    with forward_context(meta):
        hidden = runner.model(torch.tensor(tokens[:n], device=device), torch.arange(n, device=device))
    return runner.model.compute_logits(hidden[want : want + 1]).float()[0]
