"""LLMEngine's request record and its launched-step helpers (apart to keep llm_engine.py short)."""

from __future__ import annotations

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
