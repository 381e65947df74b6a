"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): the log-probability of every prompt token
given the tokens before it, computed from the hidden states of the steps that run the prompt.

The hidden state at position p predicts token p + 1, so a prefill chunk covering positions [start, end)
gives the logprobs of prompt tokens start + 1 .. min(end, P - 1) (P prompt tokens; token 0 has none).
Chunked prefill therefore fills a sequence's list chunk by chunk; a request asking for prompt logprobs
skips the prefix cache (BlockManager.find_cached_prefix), as in vLLM, so every position is computed.
Logits are computed `_ROWS` positions at a time, so a long prompt never holds [P, V] float32 logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxrewrite.kernels.log_softmax import log_softmax_float32

_ROWS = 512


@dataclass
class PromptLogprobsChunk:
    """Logprobs of prompt tokens first_pos .. first_pos + len(token_ids) - 1 of one sequence (on the host).

    token_ids [N] (the prompt's own tokens), logprobs [N] and ranks [N] (1 = most likely), top_ids and
    top_logprobs [N, k] for SamplingParams.prompt_logprobs = k.
    """

    seq_id: int
    first_pos: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def wants_prompt_logprobs(s) -> bool:
    """Whether this scheduled sequence's chunk covers prompt positions whose next token is in the prompt."""
    seq = s.seq
    return seq.prompt_logprobs is not None and s.start < seq.num_prompt_tokens - 1


def compute_prompt_logprobs(compute_logits, hidden: torch.Tensor, scheduled: list) -> list[PromptLogprobsChunk]:
    """One chunk per scheduled sequence that wants them. `hidden` [T, H]: the step's flattened hidden
    states, sequences in `scheduled` order; compute_logits: hidden [N, H] -> logits [N, V]. Waits for the
    device (prompt logprobs are for evaluation, not for the decode loop)."""
    chunks, offset = [], 0
    for s in scheduled:
        if wants_prompt_logprobs(s):
            seq = s.seq
            end = min(s.start + s.num_new_tokens, seq.num_prompt_tokens - 1)
            targets = seq.token_ids[s.start + 1 : end + 1]
            rows = torch.arange(offset, offset + end - s.start, device=hidden.device)
            chunks.append(_chunk(compute_logits, hidden, rows, seq, s.start, targets))
        offset += s.num_new_tokens
    return chunks


def _chunk(compute_logits, hidden, rows, seq, first_pos, targets) -> PromptLogprobsChunk:
    k = seq.sampling_params.prompt_logprobs
    target_t = torch.tensor(targets, dtype=torch.int64, device=hidden.device)
    lps, ranks, top_v, top_i = [], [], [], []
    for lo in range(0, len(targets), _ROWS):
        logprobs = log_softmax_float32(compute_logits(hidden[rows[lo : lo + _ROWS]]))
        chosen = logprobs.gather(1, target_t[lo : lo + _ROWS, None])
        lps.append(chosen.squeeze(1))
        ranks.append((logprobs > chosen).sum(dim=-1) + 1)
        if k > 0:
            values, ids = logprobs.topk(k, dim=-1)
            top_v.append(values)
            top_i.append(ids)
    return PromptLogprobsChunk(
        seq.seq_id, first_pos + 1, list(targets), torch.cat(lps).tolist(), torch.cat(ranks).tolist(),
        torch.cat(top_i).tolist() if k > 0 else [[] for _ in targets],
        torch.cat(top_v).tolist() if k > 0 else [[] for _ in targets],
    )
