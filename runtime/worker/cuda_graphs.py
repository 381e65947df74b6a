"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed over static buffers.

nano-vllm's scheme (`ModelRunner.capture_cudagraph` / `run_model`): buckets 1, 2, 4, 8, then every 16
up to 512 and every 64 up to max_num_seqs (at most 1024), captured largest first into one shared memory
pool. A decode step of n sequences copies its inputs into the first n rows of the static buffers, pads
up to the next bucket (padding rows write no KV: slot -1) and replays that bucket's graph. Prefill and mixed steps, larger
batches and `enforce_eager` run eagerly. Under DP x EP (`fxrewrite.layers.moe_dp`) the graphs are
captured with every replica at the same bucket (`data_parallel.uniform_tokens`), and each decode wave
the worker sets `step_bucket`, one bucket for all replicas (0: this wave runs eagerly everywhere); a
replica without work replays that bucket's graph on padding rows (`run_idle`) so the collectives meet.
Buckets of at most `greedy_head.MAX_BATCH` rows also capture the LM head and the greedy sampler
(`runtime/worker/greedy_head.py`). A compiled model's bucket is captured twice, from its compiled and its eager
forward, and the graph whose replay is faster is kept (`compilation.compiled_model_forwards`).
"""

from __future__ import annotations

import bisect
import logging
import os
import time

import torch
from torch import nn

from fxrewrite import data_parallel, distributed
from fxrewrite.layers.fused_moe import FusedMoE
from fxrewrite.layers.rope_context import rope_lengths
from fxrewrite.runtime.worker.compilation import (COMPILED_FORWARD_ENV, eager_forwards_active, forward_or_fallback,
                                                  forwards_of, model_forwards)
from fxrewrite.runtime.worker.forward_context import AttentionMetadata, forward_context
from fxrewrite.runtime.worker import greedy_head, watchdog
from fxrewrite.runtime.worker.greedy_head import GreedyHead
from fxrewrite.runtime.worker.pipeline import pipeline_stage_of_this_rank

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 1024
# Above this, buckets every 64 rows: RL rollouts run 1024 sequences at once (a step past the largest
# bucket runs eagerly, its host work then the step's cost), and a coarser grid keeps the graph count down.
_FINE_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Bucket sizes, ascending: 1, 2, 4, 8, then multiples of 16 up to 512 and of 64 up to
    min(max_num_seqs, 1024), plus that top size itself so every decode batch the scheduler can form
    (with max_num_seqs <= 1024) has a bucket."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, min(top, _FINE_CAPTURE_SIZE) + 1, 16))
    sizes += list(range(_FINE_CAPTURE_SIZE + 64, top + 1, 64))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class CUDAGraphRunner:
    """Captures `model(input_ids, positions)` for decode batches and replays it.

    Static buffers (max bucket B rows): input_ids, positions, slot_mapping, rope_lengths [B] int64 (the rows of one
    [4, B] buffer, so a step's per-token values arrive in one copy), seq_lens [B] int32, query_start_loc [B+1]
    int32 (always 0..B: one token per sequence), block_tables [B, ceil(max_model_len / block_size)] int32, outputs [B, hidden] in the model dtype.
    Graphs are captured with max_seq_len = max_model_len (it sizes the split-K grid of the decode
    kernel, so it must bound every later seq_len) against the engine's KV caches, which must not be
    reallocated afterwards. With `capture_head`, buckets up to `greedy_head.MAX_BATCH` rows end with the LM head
    and the greedy sampler (their outputs: `head`).
    """

    def __init__(self, model: nn.Module, kv_caches, *, max_num_seqs: int, max_model_len: int,
                 block_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 capture_head: bool = False):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        rows, max_blocks = self.sizes[-1], -(-max_model_len // block_size)
        # prepare_inputs' per_token order: positions, slot_mapping, rope_lengths (per-token RoPE lengths)
        self.per_token = torch.zeros(4, rows, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.rope_lengths = self.per_token.unbind(0)
        self.rope_lengths.fill_(1)
        self.slot_mapping.fill_(-1)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(rows, max_blocks, dtype=torch.int32, device=device)
        self.outputs = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.head_max_batch = greedy_head.MAX_BATCH if capture_head else 0
        self.heads: dict[int, GreedyHead] = {}
        """bucket -> its graph's head outputs (buckets whose graph has the head)."""
        self.pool = None
        self.forward_kind: dict[int, str] = {}
        """bucket -> the forward its graph holds: "compiled", "eager" (the faster under -O > 0) or "model"."""
        self.replay_ms: dict[int, dict[str, float]] = {}
        """bucket -> {"compiled": ms, "eager": ms}: the replay times the choice was made on, over the capture's
        rows (one-token contexts; a profile at longer contexts replays slower, by the attention's extra work)."""
        self.step_bucket: int | None = None
        """None: each step picks its own bucket. Under DP x EP, set per wave by the worker: the bucket every
        replica replays (at least this step's size), or 0 when the wave runs eagerly on every replica."""

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            seq_lens=self.seq_lens[:bs], query_start_loc=self.query_start_loc[: bs + 1],
            max_query_len=1, max_seq_len=self.max_model_len, kv_caches=self.kv_caches,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse the first one's pool).

        During capture every row is a 1-token sequence at position 0 that writes nothing (slot -1).
        A bucket whose capture fails twice (the second after a fresh warm-up, which lets a layer switch
        to a fallback kernel eagerly) is left out with a warning: its batches then use the next larger
        bucket, or run eagerly above the largest captured one. Raises only when no bucket captures."""
        errors = {}
        for bs in reversed(self.sizes):
            if data_parallel.dp_ep_active():
                self._capture_in_lockstep(bs)
                continue
            for attempt in range(2):
                try:  # the retry leaves the head out: a head that cannot be captured must not cost the bucket
                    self._capture_one(bs, head=attempt == 0 and bs <= self.head_max_batch)
                    break
                except Exception as e:  # noqa: BLE001 - one bucket's failure must not drop every graph
                    errors[bs] = e
                    torch.cuda.synchronize()
            else:
                logger.warning("CUDA graph for batch size %d not captured (those batches use a larger bucket "
                               "or run eagerly): %s", bs, errors[bs])
        if not self.graphs:
            raise errors[max(errors)]
        self.sizes = sorted(self.graphs)
        if self.replay_ms:
            kept = {kind: [bs for bs in self.sizes if self.forward_kind.get(bs) == kind] for kind in ("compiled", "eager")}
            logger.info("decode CUDA graphs of the compiled model: the compiled forward is faster for buckets %s, "
                        "the eager one for %s (replays timed at capture; %s=compiled|eager to force one)",
                        kept["compiled"] or "none", kept["eager"] or "none", COMPILED_FORWARD_ENV)

    def _capture_in_lockstep(self, bs: int) -> None:
        """DP x EP: the replicas capture in lockstep (their MoE collectives meet), so a bucket that fails on
        one replica must stop the capture on all (one rank retrying or going on alone would hang the
        others): RuntimeError everywhere, and `build_graph_runner` leaves every replica eager."""
        error = None
        try:
            self._capture_one(bs, head=False)
        except Exception as e:  # noqa: BLE001 - decided together below
            error = e
        if not data_parallel.all_workers_ok(error is None, self.outputs.device):
            raise RuntimeError(f"CUDA graph capture of bucket {bs} failed on a data-parallel replica "
                               f"({'here' if error is not None else 'another one'})") from error

    def _capture_one(self, bs: int, head: bool) -> None:
        """Capture bucket `bs` (with the greedy head when `head`). A compiled model on one process captures it
        twice, its compiled and its eager forward, times both graphs' replays and keeps the faster
        (`compilation.model_forwards`); the choice and the times are in `forward_kind` / `replay_ms`. A forward whose
        capture fails leaves the other (logged); the bucket fails only when every capture does."""
        self.heads.pop(bs, None)
        kinds = model_forwards(self.model)
        captured, error = {}, None
        for kind in kinds:
            try:
                with forwards_of(kind):
                    captured[kind] = self._capture_graph(bs, head)
            except Exception as e:  # noqa: BLE001 - the other forward's graph may still serve the bucket
                if len(kinds) == 1:
                    raise
                logger.warning("CUDA graph of the %s forward for batch size %d not captured: %s", kind, bs, e)
                error = e
                if torch.cuda.is_available():  # as `capture` does after a failed bucket
                    torch.cuda.synchronize()
        if not captured:
            raise error
        if not getattr(self.model, "_fxrewrite_compiled", False) and len(kinds) > 1:
            kind = next(iter(captured))  # the compile failed meanwhile (`forward_or_fallback`): eager graphs only
            self.forward_kind[bs] = "model"
        else:
            if len(captured) > 1:
                # timed on the capture's rows (one-token contexts): the attention kernel is the same in both graphs,
                # so the difference is the rest of the step
                self.replay_ms[bs] = {kind: self._replay_ms(graph) for kind, (graph, _) in captured.items()}
                kind = min(captured, key=self.replay_ms[bs].get)  # kinds' order breaks a tie: compiled first
            else:
                kind = next(iter(captured))
            self.forward_kind[bs] = kind
        graph, outputs = captured.pop(kind)
        captured.clear()  # the other graph's memory goes back to the shared pool
        if outputs is not None:
            self.heads[bs] = outputs
        self.graphs[bs] = graph

    def _replay_ms(self, graph) -> float:
        return replay_ms(graph)

    def _capture_graph(self, bs: int, head: bool) -> tuple[torch.cuda.CUDAGraph, GreedyHead | None]:
        graph = torch.cuda.CUDAGraph()
        with (forward_context(self._metadata(bs)), rope_lengths(self.rope_lengths[:bs]),
              data_parallel.uniform_tokens()):
            # Warm-up outside the graph: Triton JIT and torch.compile run here, not while capturing.
            watchdog.phase(f"CUDA graph bucket {bs}: eager warm-up forward")
            self.outputs[:bs] = forward_or_fallback(self.model, self.input_ids[:bs], self.positions[:bs])
            if head:
                GreedyHead.compute(self.model, self.outputs[:bs])
            watchdog.phase(f"CUDA graph bucket {bs}: capture")
            with torch.cuda.graph(graph, self.pool):
                self.outputs[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])
                outputs = GreedyHead.compute(self.model, self.outputs[:bs]) if head else None
        if self.pool is None:
            self.pool = graph.pool()
        torch.cuda.synchronize()
        return graph, outputs

    def can_run(self, num_tokens: int, metadata: AttentionMetadata) -> bool:
        """A pure decode step (one token per sequence) no larger than the largest bucket."""
        return (
            bool(self.graphs)
            and self.step_bucket != 0
            and metadata.max_query_len == 1
            and num_tokens == metadata.seq_lens.shape[0]
            and num_tokens <= self.max_batch_size
            and metadata.max_seq_len <= self.max_model_len
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
            lengths: torch.Tensor | None = None, per_token: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids/positions/lengths (per-token RoPE lengths, default position + 1) [n] of n decoding
        sequences -> hidden [n, hidden] (a view of the static output buffer, valid until the next
        replay). per_token: None, or [3, n] int64 holding positions, metadata.slot_mapping and lengths as its
        rows (`StepInputs.per_token`): one copy instead of three. Call only when `can_run` is True."""
        n = input_ids.shape[0]
        bs = self.bucket(max(n, self.step_bucket or 0))
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        if per_token is not None:
            self.per_token[1:, :n].copy_(per_token, non_blocking=True)
        else:
            self.positions[:n].copy_(positions, non_blocking=True)
            self.rope_lengths[:n].copy_(lengths if lengths is not None else positions + 1, non_blocking=True)
            self.slot_mapping[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self.rope_lengths[n:bs].fill_(1)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        self.seq_lens[n:bs].fill_(1)
        width = metadata.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(metadata.block_tables, non_blocking=True)
        self.graphs[bs].replay()
        return self.outputs[:n]

    def head(self, n: int) -> GreedyHead | None:
        """After `run` of n sequences: the head outputs of its rows when its bucket's graph has the head."""
        outputs = self.heads.get(self.bucket(max(n, self.step_bucket or 0)))
        return outputs.rows(n) if outputs is not None else None

    def bucket(self, n: int) -> int:
        """The smallest captured size >= n (n <= max_batch_size)."""
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def run_idle(self, bs: int) -> None:
        """Replay bucket `bs` on padding rows only (slot -1: no KV written, outputs unused): a DP x EP
        replica without work in a decode wave joins the other replicas' MoE collectives."""
        self.input_ids[:bs].zero_()
        self.positions[:bs].zero_()
        self.rope_lengths[:bs].fill_(1)
        self.slot_mapping[:bs].fill_(-1)
        self.seq_lens[:bs].fill_(1)
        self.graphs[bs].replay()


def build_graph_runner(model: nn.Module, kv_caches, config, model_config,
                       device: torch.device) -> CUDAGraphRunner | None:
    """A captured CUDAGraphRunner on CUDA unless `config.enforce_eager` or a batch-invariant MoE model; None
    otherwise, or (logged as a warning, steps then run eagerly) when the model cannot be captured."""
    emulate = device.type == "cpu" and not config.enforce_eager and os.environ.get(EMULATE_ENV) == "1"
    if not emulate and (device.type != "cuda" or config.enforce_eager):
        return None
    if config.batch_invariant and any(isinstance(m, FusedMoE) for m in model.modules()):
        logger.info("batch_invariant=True: the MoE blocks route through their reference path (data-dependent "
                    "shapes, no CUDA graph can hold it), so decode runs eagerly")
        return None
    kwargs = dict(max_num_seqs=config.max_num_seqs, max_model_len=model_config.max_model_len,
                  block_size=config.block_size, hidden_size=model_config.hidden_size, dtype=model_config.dtype,
                  device=device, capture_head=wants_greedy_head(config))
    if emulate:
        runner = EmulatedGraphRunner(model, kv_caches, **kwargs)
        runner.capture()
        return runner
    # A compiled model's static buffers are inference tensors, like every eager step's inputs: dynamo guards on
    # the kind, so normal-tensor buffers would cost each compiled graph a second Inductor compile.
    with torch.inference_mode(bool(getattr(model, "_fxrewrite_compiled", False))):
        runner = CUDAGraphRunner(model, kv_caches, **kwargs)
    try:
        runner.capture()
    except Exception as e:  # a model with a host sync in its forward (e.g. dynamic NTK rope)
        logger.warning("CUDA graph capture failed, decode runs eagerly: %s", e)
        return None
    return runner


def replay_ms(graph: torch.cuda.CUDAGraph, iters: int = 5, warmup: int = 2) -> float:
    """Milliseconds per replay of a captured `graph`: `warmup` replays, then `iters` timed with CUDA events (GPU
    time only, no launch overhead)."""
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def wants_greedy_head(config) -> bool:
    """Whether small decode graphs capture the LM head and greedy sampler: `greedy_head.enabled()`, a generating
    model (not pooling) on one rank that samples itself (no tensor, pipeline or DP x EP peers in its head)."""
    return (greedy_head.enabled() and not config.is_pooling and distributed.get_tp_size() == 1
            and pipeline_stage_of_this_rank() is None and not data_parallel.dp_ep_active())


EMULATE_ENV = "FXREWRITE_EMULATE_CUDA_GRAPHS"
"""Set to 1 (CPU tests): a CPU engine gets an `EmulatedGraphRunner`, so the bucket protocol (padding,
DP x EP waves at one bucket, idle replicas replaying padding rows) runs without a GPU."""


class _EagerReplay:
    """One bucket's stand-in for a captured graph: `replay()` runs the forward the graph would replay."""

    def __init__(self, runner: CUDAGraphRunner, bs: int, head: bool, eager: bool = False):
        self.runner, self.bs, self.has_head = runner, bs, head
        self.eager = eager  # "captured" inside `eager_forwards` (a compiled model's eager forward): replayed so

    def replay(self) -> None:
        r, bs = self.runner, self.bs
        with (forward_context(r._metadata(bs)), rope_lengths(r.rope_lengths[:bs]), data_parallel.uniform_tokens(),
              forwards_of("eager" if self.eager else "model")):
            r.outputs[:bs] = r.model(r.input_ids[:bs], r.positions[:bs])
            if self.has_head:
                head = GreedyHead.compute(r.model, r.outputs[:bs])
                if bs in r.heads:  # into the same tensors, as a graph's replay writes its outputs
                    r.heads[bs].copy_(head)
                else:
                    r.heads[bs] = head


class EmulatedGraphRunner(CUDAGraphRunner):
    """`CUDAGraphRunner` whose buckets run eagerly over the same static buffers (CPU tests: `EMULATE_ENV`)."""

    def _capture_graph(self, bs: int, head: bool) -> tuple[_EagerReplay, None]:
        """As the capture's warm-up: one forward with uniform row counts (`capture` calls this largest
        bucket first, in lockstep under DP x EP), so the CPU tests run the load-time collectives the GPU does; a
        compiled model's bucket goes through the choice of forwards as on the GPU (`_capture_one`)."""
        watchdog.phase(f"emulated CUDA graph bucket {bs}: warm-up forward")
        graph = _EagerReplay(self, bs, head, eager=eager_forwards_active())
        graph.replay()
        return graph, None

    def _replay_ms(self, graph: _EagerReplay) -> float:
        start = time.perf_counter()
        graph.replay()
        return (time.perf_counter() - start) * 1e3
