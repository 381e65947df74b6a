"""One completion being generated: its tokens, KV blocks and progress."""

from __future__ import annotations

import itertools
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from fxrewrite.runtime.engine.text_pieces import TextPieces

if TYPE_CHECKING:
    from fxrewrite.runtime.engine.outputs import Logprob
    from fxrewrite.runtime.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Token ids (prompt then output), the block table and how many tokens have KV in the cache.

    `num_computed_tokens` counts tokens whose K/V are in the cache; tokens after it are fed to the
    model in the next steps (a chunk of the prompt, or the last sampled token when decoding).

    With async scheduling a sampled token stays on the device while the next step is scheduled:
    `num_pending_tokens` (0 to 2) counts those, so `num_tokens` (what the scheduler plans with) is
    `len(token_ids) + num_pending_tokens`, while `token_ids` and `num_output_tokens` hold only tokens
    that reached the host.
    """

    _counter = itertools.count()

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        index: int = 0,
        arrival: int = 0,
    ):
        self.seq_id = next(Sequence._counter)
        self.request_id = request_id
        self.index = index
        self.arrival = arrival
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_pending_tokens = 0
        self.awaiting_final_token = False
        """True once the token in flight is sure to be the last (max_tokens / max_model_len): the
        scheduler stops scheduling the sequence while that token comes back."""
        self.rope_prefill_len = self.num_prompt_tokens
        """Length of the sequence when its KV was last computed from scratch: the prompt, or the whole
        sequence after a LongRoPE switch (`Scheduler`). Token p's RoPE length is max(this, p + 1): what
        transformers' rotary saw when it computed that token in cached generation (its `max(position_ids)
        + 1` for a batch of one), read by length-dependent rope types (fxrewrite.layers.rope_context)."""
        self.block_hash_salt: int | None = None
        """Starts the chain of block hashes: set when the KV depends on rope_prefill_len (see Scheduler)."""
        self.cache_salt: str | None = None
        """The request's ``cache_salt`` (vLLM's): it starts the hash chain too, so that only requests with the same
        salt share cached blocks (`BlockManager`)."""
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.token_block_hashes: list[int] = []
        """Chained hashes of the full blocks of token_ids, filled lazily by the block manager; token_ids
        only grow, so these stay valid across preemption (unlike block_hashes, which follow the table)."""
        self.output_logprobs: list[dict[int, Logprob]] = []
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] * self.num_prompt_tokens if sampling_params.prompt_logprobs is not None else None)
        """With SamplingParams.prompt_logprobs: per prompt token (the first has none), filled by the steps
        that run the prompt."""
        self.bad_words_token_ids: list[list[int]] = []
        """SamplingParams.bad_words as token ids (set by the engine, which owns the tokenizer)."""
        self.cumulative_logprob = 0.0
        self._text = TextPieces()
        self.num_sent_tokens = self.num_sent_chars = 0
        """Output tokens and characters of text already in the request's outputs (RequestOutputKind.DELTA)."""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.seed = None if sampling_params.seed is None else sampling_params.seed + index
        """Seed of this sequence's own sampling noise (completion i of a request uses seed + i)."""
        self.generator: torch.Generator | None = None
        """Made by the sampler on the logits' device at the first sample (see `generator_on`)."""

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def text(self) -> str:
        """The output text so far (`TextPieces`: appends and tail reads do not copy the whole string)."""
        return self._text.text()

    @text.setter
    def text(self, value: str) -> None:
        self._text.set(value)

    @property
    def text_len(self) -> int:
        return self._text.length

    def append_text(self, piece: str) -> None:
        self._text.append(piece)

    def text_from(self, start: int) -> str:
        """text[start:] (start >= 0), reading only the pieces it spans."""
        return self._text.slice(start)

    @property
    def num_tokens(self) -> int:
        """Tokens including the ones sampled but not yet back on the host."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Output tokens on the host (pending ones not counted)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """A sampled token reached the host: it replaces the oldest pending one, if any."""
        self.token_ids.append(token_id)
        if self.num_pending_tokens:
            self.num_pending_tokens -= 1

    def generator_on(self, device: torch.device) -> torch.Generator | None:
        """This seeded sequence's generator on `device` (None when unseeded); made once, then it advances."""
        if self.seed is None:
            return None
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.seed)
        return self.generator
