"""Kernel warm-up at load: eager dummy steps that make Triton build, before the first request, every kernel
specialisation a serving step can reach (vLLM warms up with dummy runs at start-up for the same reason).

Triton compiles one binary per combination of constexprs and of "specialisations" of the other
arguments (an int equal to 1 or divisible by 16, a pointer aligned to 16 bytes). Arguments that change
with the batch (block-table width, split count, token counts) are marked ``do_not_specialize`` in the
kernels, and the pointers into the engine's packed step buffers (positions, slot_mapping, seq_lens,
query_start_loc: their alignment follows the token and sequence counts) ``do_not_specialize_on_alignment``
(without them one kernel had up to 12 variants and the benchmark's first arm compiled some inside its
timed run). What is left to warm up is a handful of launch classes: a prefill step (single sequence,
token counts not divisible by 16, a mixed batch of a one-token sequence and a longer one) and eager
decode steps at each split-count class of the decode kernel (`decode_warmup_cases`). Decode buckets
are compiled by the CUDA graph capture that follows. Dummy steps write no KV (every slot is -1) and
read block 0, so they leave the cache as they found it.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from torch import nn

from fxrewrite import data_parallel
from fxrewrite.kernels.paged_decode import decode_warmup_cases
from fxrewrite.kernels.triton_utils import watch_jit_compiles
from fxrewrite.layers.rope_context import rope_lengths
from fxrewrite.runtime.worker.compilation import compiled_model_forwards, forward_or_fallback, forwards_of
from fxrewrite.runtime.worker.forward_context import AttentionMetadata, forward_context
from fxrewrite.runtime.worker import watchdog

logger = logging.getLogger(__name__)

PREFILL_CASES: tuple[tuple[tuple[int, int], ...], ...] = (
    ((17, 17),),  # one sequence, 17 new tokens: an odd count
    ((32, 32),),  # a count divisible by 16
    ((1, 40), (23, 23)),  # a mixed step: one decoding sequence (40 tokens of context) and a prefill
    ((5, 200),),  # a chunk after a cached prefix of 195 tokens
)
"""Per dummy prefill step: (query tokens, seq_len) of each sequence."""


WARMUP_ENV = "FXREWRITE_KERNEL_WARMUP"
"""1: run the warm-up on any device (CPU tests of the load sequence: its MoE collectives under DP x EP);
0: never; unset: on CUDA only (Triton compiles there)."""


def should_warm_up(device: torch.device, pipeline) -> bool:
    """Whether the model runner runs `warm_up_kernels` at load: on CUDA (or as `WARMUP_ENV` says), and not
    on a pipeline stage (its forward needs its peers' hidden states)."""
    if pipeline is not None:
        return False
    switch = os.environ.get(WARMUP_ENV)
    return switch == "1" if switch in ("0", "1") else device.type == "cuda"


def dummy_metadata(seqs: tuple[tuple[int, int], ...], block_size: int, device: torch.device,
                   kv_caches) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions [T], metadata) of a step whose sequences have (q_len, seq_len) each: no KV written
    (slot -1), every block-table entry 0, so it reads only block 0 of each layer's cache."""
    q_lens = [q for q, _ in seqs]
    positions = torch.cat([torch.arange(s - q, s) for q, s in seqs]).to(device)
    width = max(-(-s // block_size) for _, s in seqs)
    starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros(len(seqs), width, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([s for _, s in seqs], dtype=torch.int32, device=device),
        query_start_loc=starts.to(device), max_query_len=max(q_lens), max_seq_len=max(s for _, s in seqs),
        kv_caches=kv_caches,
    )
    return positions, metadata


def warmup_steps(model_config, max_model_len: int) -> list[tuple[tuple[int, int], ...]]:
    """The dummy steps' sequences: `PREFILL_CASES` that fit in max_model_len, then one decode step per
    `decode_warmup_cases` entry."""
    steps = [case for case in PREFILL_CASES if all(s <= max_model_len for _, s in case)]
    for num_seqs, seq_len in decode_warmup_cases(model_config.num_key_value_heads, max_model_len):
        steps.append(((1, seq_len),) * num_seqs)
    return steps


@torch.inference_mode()
def warm_up_kernels(model: nn.Module, kv_caches, config, model_config, device: torch.device) -> list[str]:
    """Run the dummy steps eagerly (logits of each step's last rows included); returns the Triton
    specialisations built meanwhile (empty when triton was not compiling, e.g. on a CPU)."""
    start = time.perf_counter()
    with watch_jit_compiles() as built:
        run_dummy_steps(model, kv_caches, config, device, warmup_steps(model_config, model_config.max_model_len),
                        "kernel warm-up step")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("kernel warm-up: %d Triton specialisations in %.1f s", len(built), time.perf_counter() - start)
    return built


@torch.inference_mode()
def run_dummy_steps(model: nn.Module, kv_caches, config, device: torch.device, steps, label: str) -> None:
    """Each step of (q_len, seq_len) sequences through the model and its logits; writes no KV (see dummy_metadata)."""
    for i, seqs in enumerate(steps):
        watchdog.phase(f"{label} {i + 1}/{len(steps)} ({len(seqs)} sequences, {sum(q for q, _ in seqs)} tokens)")
        positions, metadata = dummy_metadata(seqs, config.block_size, device, kv_caches)
        hidden = dummy_forward(model, metadata, positions)
        model.compute_logits(hidden[metadata.query_start_loc[1:].long() - 1])


def dummy_forward(model: nn.Module, metadata: AttentionMetadata, positions: torch.Tensor,
                  input_ids: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [T, H] of one step with `metadata` (`dummy_metadata`'s) at `positions` [T], token id 0 everywhere
    unless `input_ids` [T] are given."""
    input_ids = torch.zeros_like(positions) if input_ids is None else input_ids.to(positions.device)
    # Every DP x EP replica runs these same steps: their MoE collectives need no token-count exchange.
    with forward_context(metadata), rope_lengths(positions + 1), data_parallel.uniform_tokens():
        return forward_or_fallback(model, input_ids, positions)


@torch.inference_mode()
def faster_step_forward(model: nn.Module, kv_caches, config, model_config,
                        device: torch.device) -> tuple[str, dict[str, float]]:
    """Which forward of a compiled model the steps outside CUDA graphs (prefill, mixed and large decode steps) run:
    of `compiled_model_forwards()`, the one whose dummy step of a full chunk (one sequence of
    min(max_num_batched_tokens, max_model_len) tokens) takes less wall time, host work included (each compiled
    layer call checks dynamo's guards). Returns (kind, {kind: seconds, the fastest of 3 steps}); the times are empty
    when there is one kind, and ("model", {}) when the compile failed meanwhile (the model then runs eagerly). The
    first step of each kind is not timed (it compiles, or builds Triton kernels)."""
    kinds = compiled_model_forwards()
    if len(kinds) == 1:
        return kinds[0], {}
    tokens = min(config.max_num_batched_tokens, model_config.max_model_len)
    positions, metadata = dummy_metadata(((tokens, tokens),), config.block_size, device, kv_caches)
    seconds = {}
    for kind in kinds:
        watchdog.phase(f"timing the {kind} forward on a step of {tokens} tokens")
        with forwards_of(kind):
            dummy_forward(model, metadata, positions)
            _synchronize(device)
            runs = []
            for _ in range(3):
                start = time.perf_counter()
                dummy_forward(model, metadata, positions)
                _synchronize(device)
                runs.append(time.perf_counter() - start)
            seconds[kind] = min(runs)
    if not getattr(model, "_fxrewrite_compiled", False):  # the compile failed meanwhile (`forward_or_fallback`)
        return "model", {}
    return min(kinds, key=seconds.get), seconds


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
