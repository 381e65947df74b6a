"""The LM head and the greedy sampler inside small decode CUDA graphs.

After a decode graph's forward, a batch-1 step used to launch the LM head and the sampler's kernels eagerly, each
with its host launch and a gap on the device that a graph replay does not have. For buckets of at most `MAX_BATCH`
rows the graph also runs `compute_logits` and `fxrewrite.kernels.greedy_sample` (what `Sampler.sample` runs for a
plain greedy batch, so the same values), and the model runner takes the graph's tokens when every sampling
sequence is plain greedy (`Sampler.is_plain_greedy`), or runs the sampler on the graph's logits otherwise
(SGLang captures its logits processor in the decode graphs the same way).

`FXREWRITE_GRAPH_LOGITS` = on (default) | off: off keeps the head and the sampler out of the graphs (to measure
what it buys).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxrewrite.kernels import on_off_switch
from fxrewrite.kernels.greedy_sample import greedy_sample

ENV = "FXREWRITE_GRAPH_LOGITS"
MAX_BATCH = 16
"""Largest bucket with the head in its graph (its logits [bs, vocab] stay in the graphs' memory pool); above it the
eager launches are a small part of a step."""


def enabled() -> bool:
    """Whether decode graphs capture the LM head and greedy sampler (`ENV`, default on); ValueError naming a bad
    value."""
    return on_off_switch(ENV, "on")


@dataclass
class GreedyHead:
    """One bucket's head outputs, static across replays (valid until the next replay of any bucket).

    logits [bs, V] in the LM head's dtype; tokens [bs] int64 (argmax); packed [bs, 2] float64 (token id, its
    log-softmax), what `SampledTokens` copies to the host.
    """

    logits: torch.Tensor
    tokens: torch.Tensor
    packed: torch.Tensor

    @classmethod
    def compute(cls, model, hidden: torch.Tensor) -> "GreedyHead":
        """hidden [bs, H] -> the head's outputs (captured in the graph, or run eagerly to emulate it)."""
        logits = model.compute_logits(hidden)
        tokens, packed = greedy_sample(logits)
        return cls(logits, tokens, packed)

    def copy_(self, other: "GreedyHead") -> None:
        for mine, theirs in ((self.logits, other.logits), (self.tokens, other.tokens), (self.packed, other.packed)):
            mine.copy_(theirs)

    def rows(self, n: int) -> "GreedyHead":
        """The first n rows (the step's sequences; the rest are the bucket's padding)."""
        return GreedyHead(self.logits[:n], self.tokens[:n], self.packed[:n])
