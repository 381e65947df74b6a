"""What the engine returns per request, shaped like vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability (natural log, from the model's raw logits) of one token and its rank (1 = top)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion of a request; text, token_ids and logprobs are cumulative, or only what is new since the
    request's previous output under `RequestOutputKind.DELTA`."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    """Per generated token: {token_id: Logprob} with the sampled token and the top-k."""
    finish_reason: str | None = None
    """None while running, then "stop" (EOS, stop token or stop string) or "length"."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended it (None for EOS or length)."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step: its prompt and its n completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With SamplingParams.prompt_logprobs: None for the first prompt token, then {token_id: Logprob}
    (the prompt token itself and the top prompt_logprobs) per prompt token."""
    metrics: dict = field(default_factory=dict)

    @property
    def num_cached_tokens(self) -> int:
        return int(self.metrics.get("num_cached_tokens", 0))
