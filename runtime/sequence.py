"""One completion being generated: its tokens, KV blocks and progress."""

from __future__ import annotations

import itertools
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fxrewrite.runtime.outputs import Logprob
    from fxrewrite.runtime.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Token ids (prompt then output), the block table and how many tokens have KV in the cache.

    `num_computed_tokens` counts tokens whose K/V are in the cache; tokens after it are fed to the
    model in the next steps (a chunk of the prompt, or the last sampled token when decoding).
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
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.output_logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.generator = _make_generator(sampling_params.seed, index)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
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
        self.token_ids.append(token_id)


def _make_generator(seed: int | None, index: int) -> torch.Generator | None:
    """A CPU generator per seeded sequence; completion i of a request uses seed + i."""
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(seed + index)
    return generator
