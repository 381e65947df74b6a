"""LLMEngine's request record and its launched-step helpers (apart to keep llm_engine.py short)."""

from __future__ import annotations

from fxrewrite.runtime.engine.detokenizer import visible_len, visible_text
from fxrewrite.runtime.engine.outputs import CompletionOutput, RequestOutput
from fxrewrite.runtime.engine.pooling import pooling_output
from fxrewrite.runtime.engine.sampler import SampleResult
from fxrewrite.runtime.engine.sampling_params import RequestOutputKind
from fxrewrite.runtime.engine.scheduler import SchedulerOutput
from fxrewrite.runtime.engine.sequence import Sequence, SequenceStatus

_FINISHED = SequenceStatus.FINISHED


class Request:
    """A prompt and its n sequences (one per completion)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params, arrival,
                 pooling=None, final_only: bool = False):
        self.request_id = request_id
        kind = getattr(params, "output_kind", RequestOutputKind.CUMULATIVE)  # PoolingParams have none
        self.final_only = final_only or kind == RequestOutputKind.FINAL_ONLY  # a RequestOutput only once finished
        self.delta = kind == RequestOutputKind.DELTA and not final_only  # outputs carry what is new since the last
        self.prompt_logprobs_sent = False  # DELTA: prompt logprobs go out once
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = params
        self.seqs = [Sequence(request_id, prompt_token_ids, params, i, arrival) for i in range(params.n)]
        self.pooling_params = pooling  # PoolingParams of an embedding request (runner='pooling')

    @property
    def finished(self) -> bool:
        for seq in self.seqs:  # a loop, not all(<generator>): read for every request that ends a step
            if seq.status is not _FINISHED:
                return False
        return True


def make_output(request: Request, requests: dict[str, Request], embeddings) -> RequestOutput:
    """`request`'s RequestOutput now (cumulative, or what is new since its last under DELTA); a finished request is
    removed from `requests`. Built for every request that progressed, every step (the streaming contract): one
    pass, no generator expressions or properties in the per-sequence loop."""
    if request.pooling_params is not None:
        return pooling_output(request, embeddings, requests)
    params = request.sampling_params
    want_logprobs, hold_text, delta = params.logprobs is not None, bool(params.stop_strings), request.delta
    outputs, cached, finished = [], 0, True
    for seq in request.seqs:
        start = seq.num_prompt_tokens
        if delta:  # what is new since this request's last output (held-back text never shrinks)
            start += seq.num_sent_tokens
            seq.num_sent_tokens = len(seq.token_ids) - seq.num_prompt_tokens
            sent, end = seq.num_sent_chars, visible_len(seq) if hold_text else seq.text_len
            text, seq.num_sent_chars = seq.text_from(sent)[: end - sent], end
        else:
            text = visible_text(seq) if hold_text else seq.text  # visible_text is seq.text without stop strings
        outputs.append(CompletionOutput(
            seq.index,
            text,
            seq.token_ids[start:],
            seq.cumulative_logprob if want_logprobs else None,
            seq.output_logprobs[start - seq.num_prompt_tokens:] if want_logprobs else None,
            seq.finish_reason,
            seq.stop_reason,
        ))
        if seq.num_cached_tokens > cached:
            cached = seq.num_cached_tokens
        if seq.status is not _FINISHED:  # request.finished, in the same pass
            finished = False
    if finished:
        del requests[request.request_id]
    first = request.seqs[0]
    prompt_logprobs = first.prompt_logprobs
    if prompt_logprobs is not None and delta:  # once, in the first output after the prompt has run
        if request.prompt_logprobs_sent or (len(first.token_ids) == first.num_prompt_tokens and not finished):
            prompt_logprobs = None
        else:
            request.prompt_logprobs_sent = True
    return RequestOutput(
        request.request_id, request.prompt, request.prompt_token_ids, outputs, finished,
        prompt_logprobs=list(prompt_logprobs) if prompt_logprobs is not None else None,
        metrics={"num_cached_tokens": cached},
    )


def reads_host_tokens(sched: SchedulerOutput) -> bool:
    """Whether a sequence of `sched` samples with penalties or bad words, which read every earlier token on the
    host: the step after it waits for its tokens (found by `LLMEngine._launch`'s pass when that launched it)."""
    if sched.reads_host_tokens is not None:
        return sched.reads_host_tokens
    return any(s.seq.sampling_params.has_penalties or s.seq.sampling_params.bad_words for s in sched.scheduled)


class CompletedStep:
    """A step that ran synchronously (async scheduling off)."""

    def __init__(self, sched: SchedulerOutput, out: tuple[list[Sequence], list[SampleResult]]):
        self.sched, self._out = sched, out

    def result(self) -> tuple[list[Sequence], list[SampleResult]]:
        return self._out
