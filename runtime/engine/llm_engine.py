"""The synchronous engine: requests in, one scheduled model step per `step()`, outputs out."""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any, Iterable

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.engine.block_manager import BlockManager
from fxrewrite.runtime.engine.detokenizer import (
    IncrementalDetokenizer,
    check_stop_strings,
    check_stop_token,
    no_text,
)
from fxrewrite.runtime.engine_config import EngineConfig
from fxrewrite.runtime.engine.outputs import Logprob, RequestOutput
from fxrewrite.runtime.engine.pooling import check_sentence_transformers_pooling, pooled_rows, split_params
from fxrewrite.runtime.engine.prompts import prompt_cache_salt, tokenize_prompt, truncate_prompt
from fxrewrite.runtime.engine.rl import EngineRLMixin
from fxrewrite.runtime.engine.micro_batches import MicroBatchQueue
from fxrewrite.runtime.engine.request_state import CompletedStep, Request, make_output, reads_host_tokens
from fxrewrite.runtime.engine.rope_lengths import length_dependent_rope
from fxrewrite.runtime.engine.sampler import SampleResult
from fxrewrite.runtime.engine.request_extras import (
    check_allowed_tokens,
    check_request_extras,
    eos_token_ids,
    store_prompt_logprobs,
    whole_vocabulary_logprobs,
)
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.scheduler import Scheduler, SchedulerOutput
from fxrewrite.runtime.engine.sequence import Sequence, SequenceStatus
from fxrewrite.runtime.engine.structured_outputs import StructuredOutputManager
from fxrewrite.runtime.engine.vllm_accessors import VLLMEngineAccessors
from fxrewrite.runtime.worker.executor import create_model_runner
from fxrewrite.runtime.worker.model_runner import load_model_config, load_tokenizer

logger = logging.getLogger(__name__)
_FINISHED = SequenceStatus.FINISHED


class LLMEngine(EngineRLMixin, VLLMEngineAccessors):
    """Owns the tokenizer, model runner, block manager and scheduler.

    `add_request` validates (ValueError, nothing allocated), `step` runs one batch and returns a
    RequestOutput for every request that progressed; a finished request is forgotten after it is returned.
    """

    def __init__(self, config: EngineConfig, *, model_config=None, tokenizer=None, model_runner=None):
        self.config = config  # the keyword arguments: a data-parallel replica's (runtime/engine/data_parallel.py)
        self.model_config = model_config or load_model_config(config)
        if config.is_pooling:  # before the weights load: a MEAN / CLS Sentence Transformers model is refused
            check_sentence_transformers_pooling(self.model_config.model_path)
        self.tokenizer = tokenizer or load_tokenizer(self.model_config, config)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model_config)
        # tensor_parallel_size > 1: worker processes behind the same interface (runtime/executor.py)
        self.model_runner = model_runner or create_model_runner(config, self.model_config, self.eos_token_ids)
        self.block_manager = BlockManager(self.model_runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   length_dependent_rope(self.model_config))
        _warn_if_cache_is_short(self.block_manager, self.model_config.max_model_len)
        # The longest sequence a request without max_tokens grows to: the KV slots + 1 (the last token needs
        # none) when the cache holds less than max_model_len, where vLLM refuses to start.
        self.max_seq_len = min(self.model_config.max_model_len, self.block_manager.num_blocks * config.block_size + 1)
        self.async_scheduling = config.async_scheduling and getattr(self.model_runner, "supports_async", False)
        self._inflight = None  # the launched step whose tokens are not read back yet (async scheduling)
        depth = getattr(self.model_runner, "pipeline_depth", 1)
        self.micro_batches = MicroBatchQueue(depth) if depth > 1 else None
        """Pipeline parallelism: the batches in flight through the stages (micro_batches.py)."""
        self.requests: dict[str, Request] = {}
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}
        self._token_texts: dict[int, str] = {}  # _decode_token's cache
        self._arrivals = itertools.count()
        self._structured = None  # StructuredOutputManager, made at the first constrained request (xgrammar)
        self._structured_lock = threading.Lock()  # the server compiles grammars from several threads
        self._embeddings: dict = {}  # pooling runner: seq_id -> last-token final hidden state [H], host
        self._early_outputs = None  # the previous step's outputs, when grammar masks needed its tokens early
        self.failed_requests: dict[str, str] = {}
        """request_id -> why it failed alone (its grammar process died), already aborted: `take_failed_requests`."""

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    # requests
    def add_request(
        self, request_id: str, prompt: str | list[int] | dict, sampling_params: SamplingParams | None = None,
        *, final_only: bool = False,
    ) -> None:
        """Queue a prompt (text, token ids, or vLLM's TextPrompt / TokensPrompt dict, whose ``cache_salt`` keeps its
        cached prefix to requests of the same salt) for generation; ValueError for an invalid request. final_only:
        one RequestOutput, when it finishes (vLLM's FINAL_ONLY; offline `LLM.generate`), not one every step, as
        ``sampling_params.output_kind=RequestOutputKind.FINAL_ONLY`` asks too (DELTA: outputs of new text only)."""
        pooling, params = split_params(sampling_params, self.config.is_pooling, self.model_config)
        params.verify()  # fields may have been set after construction
        self._check_awake()
        if request_id in self.requests:
            raise UserInputError(f"request_id {request_id!r} is already in use")
        text, token_ids = tokenize_prompt(self.tokenizer, self.model_config.vocab_size, prompt)
        cache_salt = prompt_cache_salt(prompt)
        token_ids = truncate_prompt(token_ids, params.truncate_prompt_tokens, self.model_config.max_model_len)
        self._check_request(token_ids, params)
        params = whole_vocabulary_logprobs(params, self.model_config.vocab_size)
        compiled = self.compile_structured_outputs(params)
        request = Request(request_id, text, token_ids, params, next(self._arrivals), pooling, final_only)
        bad_words = params.bad_words_token_ids(self.tokenizer) if params.bad_words else []
        check_allowed_tokens(params, bad_words, self.eos_token_ids)
        self.requests[request_id] = request
        for seq in request.seqs:
            seq.bad_words_token_ids, seq.cache_salt = bad_words, cache_salt
            if compiled is not None:
                self._structured.add(seq.seq_id, params.structured_outputs, compiled)
            if params.detokenize:
                detokenizer = self._detokenizers[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, seq)
                detokenizer.deferred = request.final_only and not params.stop_strings
            self.scheduler.add(seq)

    def compile_structured_outputs(self, params: SamplingParams):
        """The compiled grammar of params.structured_outputs (None without one); ValueError when the
        schema, regex or grammar is invalid. Compiled grammars are cached, so the server checks a request
        with this before queueing it at no extra cost."""
        if params.structured_outputs is None:
            return None
        with self._structured_lock:
            if self._structured is None:
                self._structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                           self.eos_token_ids, max_rows=self.config.max_num_seqs)
        return self._structured.compile(params.structured_outputs)

    def _check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        max_len, vocab = self.model_config.max_model_len, self.model_config.vocab_size
        check_request_extras(params, self.config, vocab)
        if params.logprobs is not None and params.logprobs > vocab:  # topk over the vocabulary
            raise UserInputError(f"logprobs={params.logprobs} is more than the vocabulary size {vocab}")
        if len(token_ids) > max_len:
            raise UserInputError(f"prompt has {len(token_ids)} tokens, more than max_model_len={max_len}")
        # The last sampled token needs no KV slot; without max_tokens only the prompt must fit (max_seq_len).
        final = len(token_ids) + (params.max_tokens or 1) - 1
        needed = min(final, max(max_len - 1, len(token_ids)))  # a sequence stops at max_len tokens, the last uncached
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if needed > capacity:  # generation stops at max_model_len, so a larger max_tokens asks for that
            cap = f", up to max_model_len={max_len}" if final > max_len else ""
            what = (f"prompt {len(token_ids)} + max_tokens {params.max_tokens} - 1, the last token is not cached{cap}"
                    if params.max_tokens else "prompt")
            lower = "the prompt" if len(token_ids) > capacity else "max_tokens or max_model_len"
            raise UserInputError(f"request needs {needed} KV cache slots ({what}), more than the whole KV cache holds "
                                 f"({capacity}); raise kv_cache_memory_bytes / gpu_memory_utilization, or shorten {lower}")

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Drop a request, or each of a list of them (vLLM's ``abort_request(request_ids)``), and free their KV
        blocks now (finish_reason "abort"); unknown ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            request = self.requests.pop(rid, None)
            for seq in request.seqs if request is not None else ():
                self._finish(seq, "abort")

    def take_failed_requests(self) -> dict[str, str]:
        """The requests that failed alone since the last call (request_id -> why; aborted: blocks freed, no
        more outputs), while the others go on: the server fails their responses, `LLM.generate` raises."""
        failed, self.failed_requests = self.failed_requests, {}
        return failed

    def _fail_lost_grammars(self) -> None:
        """Abort the requests whose matchers died with the grammar process, recording why."""
        lost = self._structured.take_lost()
        for request_id, request in list(self.requests.items()):
            why = next((lost[s.seq_id] for s in request.seqs if s.seq_id in lost), None)
            if why is not None:
                self.failed_requests[request_id] = f"structured outputs failed: {why}"
                self.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued, running, or finished but not yet returned by `step`."""
        return bool(self.requests)

    # stepping
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; RequestOutputs (cumulative) for the requests that progressed.

        With async scheduling (the default on one process; vLLM's `async_scheduling`) the step is
        scheduled and launched before the previous one's tokens are read back, so the host's work
        overlaps the device's, and each call returns the outputs of the step launched by the call
        before. Its sampled tokens feed this step on the device; a sequence that stops on one of them
        had a token computed for nothing, which is dropped. Steps with repetition/frequency/presence
        penalties (which need every earlier token on the host) wait for the previous step first.
        """
        if self._structured is not None and self._structured.lost:
            self._fail_lost_grammars()
        if self.micro_batches is not None:
            return self.micro_batches.step(self)
        previous, self._inflight = self._inflight, None
        outputs = []
        if previous is not None and reads_host_tokens(previous.sched):
            # Completed before scheduling: a sequence that stops on one of those tokens is then not scheduled
            # (its blocks are freed; a batch that still held it would write its K/V through an empty block table).
            outputs, previous = self._complete(previous), None
        sched = self.scheduler.schedule()
        if sched.is_empty():
            if previous is not None:
                return self._complete(previous)
            if self.scheduler.waiting and not self.scheduler.running:
                # add_request checks each request fits the cache alone, so this is a bug, not a wait.
                raise RuntimeError(f"no request can be scheduled: {self.get_stats()}")
            return outputs
        self._early_outputs = None
        try:
            launched = self._launch(sched, previous)
        except BaseException:
            self._abort_all()
            raise
        if previous is not None:
            outputs = self._early_outputs if self._early_outputs is not None else self._complete(previous)
            self._early_outputs = None
        if self.async_scheduling:
            self._inflight = launched
            return outputs
        return self._complete(launched)

    def _launch(self, sched: SchedulerOutput, previous, wait: bool | None = None):
        """Launch `sched` (wait=False: never wait for its tokens, whatever async_scheduling says)."""
        runner, hook = self.model_runner, {}
        if self._structured is not None and self._structured.constrained and any(
                s.samples and s.seq.seq_id in self._structured.constrained for s in sched.scheduled):
            hook = {"bitmask_hook": lambda seqs: self._grammar_bitmask(seqs, previous)}
        if self.async_scheduling or wait is False:
            launched = runner.execute_model_async(sched, previous, **hook)
        elif getattr(runner, "supports_async", False):  # synchronous: wait, keep the prompt logprobs
            launched = runner.execute_model_async(sched, None, **hook)
            launched.result()
        else:
            launched = CompletedStep(sched, runner.execute_model(sched))
        self.scheduler.advance(sched)
        # One pass: a sampling sequence's pending token, and whether the step reads host tokens
        # (`reads_host_tokens`, asked by the next step).
        max_len, no_limit, last_params, reads_host = self.max_seq_len, 1 << 62, None, False
        for s in sched.scheduled:
            seq = s.seq
            params = seq.sampling_params
            if params is not last_params:  # requests of one generate() call usually share their params
                last_params = params
                reads_host = reads_host or params.has_penalties or bool(params.bad_words)
            if s.samples:
                num_tokens = len(seq.token_ids) + seq.num_pending_tokens + 1
                seq.num_pending_tokens += 1
                if num_tokens - seq.num_prompt_tokens >= (params.max_tokens or no_limit) or num_tokens >= max_len:
                    seq.awaiting_final_token = True
        sched.reads_host_tokens = reads_host
        return launched

    def _grammar_bitmask(self, seqs: list[Sequence], previous):
        """Called by the model runner after this step's forward launch: the mask (or a callable giving it when the
        step samples) needs the previous step's tokens; that step is completed meanwhile (see `step_bitmask`)."""
        bitmask, self._early_outputs = self._structured.step_bitmask(seqs, previous, self._complete,
                                                                     self.model_runner.device)
        return bitmask

    def _complete(self, step, grammar_done: set[int] | None = None) -> list[RequestOutput]:
        """Wait for a launched step's tokens, append them to the live sequences, check stops, return outputs
        (grammar_done: the seq_ids whose grammar the tokens complete, given when a grammar job accepts them)."""
        try:
            seqs, results = step.result()
        except BaseException:
            self._abort_all()
            raise
        self._embeddings.update(pooled_rows(step, seqs))
        if getattr(step, "prompt_logprobs", None):
            by_id = {s.seq.seq_id: s.seq for s in step.sched.scheduled}
            store_prompt_logprobs(by_id, step.prompt_logprobs, self._decode_token)
        live = [(seq, result) for seq, result in zip(seqs, results) if seq.status is not _FINISHED]
        if grammar_done is None:
            grammar_done = self._structured.accept_tokens(live) if self._structured is not None else ()
        if self._structured is not None and self._structured.lost:  # their tokens may be unmasked: dropped
            self._fail_lost_grammars()
            live = [(seq, result) for seq, result in live if seq.status is not _FINISHED]
        ended = set()  # requests with a sequence finished by these tokens: only those can end a final_only one
        process = self._process_sample
        for seq, result in live:
            if process(seq, result, seq.seq_id in grammar_done):
                ended.add(seq.request_id)
        self.scheduler.commit(step.sched)
        return self._outputs(step.sched, ended)

    def _outputs(self, sched: SchedulerOutput, ended: set[str]) -> list[RequestOutput]:
        """A RequestOutput for each request of `sched` still known, in schedule order: every step for a
        streamed request, once finished for a final_only one. A final_only request not in `ended` is not
        finished (its last sequence ends in the step that scheduled it, which then returns and forgets it),
        so it costs one dict lookup here, not a pass over its sequences. A request that finished while this step was
        in flight gives nothing, also when a new request already took its id."""
        requests, outputs, seen = self.requests, [], set()
        for s in sched.scheduled:
            request_id = s.seq.request_id
            if request_id in seen:
                continue
            seen.add(request_id)
            request = requests.get(request_id)
            if request is None or s.seq not in request.seqs:  # gone, or its id taken by a new request
                continue
            if not request.final_only or (request_id in ended and request.finished):
                outputs.append(make_output(request, self.requests, self._embeddings))
        return outputs

    def _abort_all(self) -> None:
        self._inflight = None
        for request_id in list(self.requests):
            self.abort_request(request_id)

    def _decode_token(self, token_id: int) -> str:
        """The text of one token alone (a logprob entry's decoded_token), cached: a vocabulary's worth of
        short strings at most, and a tokenizer call per logprob entry costs more than the step's sampling."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _process_sample(self, seq: Sequence, result: SampleResult, grammar_done: bool = False) -> bool:
        """Append one sampled token and check the stops; True when it finished the sequence."""
        params, token_id = seq.sampling_params, result.token_id
        seq.token_ids.append(token_id)  # seq.append_token(token_id), inlined: this runs per sequence per step
        if seq.num_pending_tokens:
            seq.num_pending_tokens -= 1
        seq.cumulative_logprob += result.logprob
        if result.top_logprobs is not None:
            decode = self._decode_token if params.detokenize else no_text
            seq.output_logprobs.append(
                {t: Logprob(lp, rank, decode(t)) for t, (lp, rank) in result.top_logprobs.items()}
            )
        if params.min_tokens or params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            reason, stop = check_stop_token(seq, token_id, self.eos_token_ids)
        else:  # what check_stop_token answers then, without the call
            reason = stop = None
        # vLLM leaves a stop token's text (EOS with skip_special_tokens=False, stop_token_ids) out.
        drop_stop_token = reason is not None and not params.include_stop_str_in_output
        detokenizer = self._detokenizers.get(seq.seq_id)
        new_text = "" if drop_stop_token or detokenizer is None or detokenizer.deferred else detokenizer.step()
        if reason is None and new_text and params.stop_strings:  # check_stop_strings' own no-op cases skipped
            stop = check_stop_strings(seq, len(new_text))
            reason = "stop" if stop is not None else None
        if grammar_done and reason is None:
            reason = "stop"  # the grammar is complete (it accepted a stop token)
        num_tokens = len(seq.token_ids)
        if reason is None and (
            num_tokens - seq.num_prompt_tokens >= (params.max_tokens or 1 << 62) or num_tokens >= self.max_seq_len
        ):
            reason = "length"
        if reason is None:
            return False
        seq.stop_reason = stop
        self._finish(seq, reason, drop_stop_token)
        return True

    def _finish(self, seq: Sequence, reason: str, drop_stop_token: bool = False) -> None:
        if seq.is_finished:
            return
        seq.finish_reason = reason
        if reason != "abort" and not self.config.is_pooling:  # its full blocks' K/V are computed: cached before they
            self.block_manager.commit(seq)  # are freed (one ending in its prefill step, max_tokens=1, never was)
        self.scheduler.finish(seq)
        detokenizer = self._detokenizers.pop(seq.seq_id, None)
        if detokenizer is not None and detokenizer.deferred:
            detokenizer.step(len(seq.token_ids) - drop_stop_token, final=True)
        if self._structured is not None:
            self._structured.remove(seq.seq_id)

    def check_health(self) -> None:
        """Raise (WorkerError) when the model can no longer run: the tensor-parallel workers died or were
        shut down. A no-op for the single-process runner (vLLM's `check_health`)."""
        check = getattr(self.model_runner, "check_health", None)
        if check is not None:
            check()

    def get_stats(self) -> dict:
        """num_running / num_waiting (sequences), kv_cache_usage (fraction 0..1 of blocks held),
        num_free_blocks / num_blocks, prefix_cache_hits / prefix_cache_queries (prompt tokens),
        num_preemptions (since start)."""
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": bm.usage(),
            "num_free_blocks": bm.num_free_blocks,
            "num_blocks": bm.num_blocks,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "num_preemptions": self.scheduler.num_preemptions,
        }


def _warn_if_cache_is_short(block_manager: BlockManager, max_model_len: int) -> None:
    """Log when one sequence of max_model_len tokens cannot fit the whole KV cache (vLLM refuses to start then)."""
    capacity = block_manager.num_blocks * block_manager.block_size
    if capacity < max_model_len:
        logger.warning("the KV cache holds %d tokens, less than max_model_len=%d: longer max_tokens are refused, no "
                       "max_tokens stops at %d tokens (the last sampled one needs no slot); raise kv_cache_memory_bytes "
                       "(on a GPU: gpu_memory_utilization) or lower max_model_len", capacity, max_model_len, capacity + 1)
