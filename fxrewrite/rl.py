"""Trainer-side helpers for RL loops that sample with the engine (`fxrewrite.LLM`).

`completion_logprobs(model, prompts, completions)` recomputes, with gradients, the log-probabilities
of sampled tokens under a causal LM (stock or `fxrewrite.optimize`d): the numbers the engine reports
with `SamplingParams(logprobs=0)` (log-softmax of the raw logits, float32), so that a GRPO/PPO ratio
exp(new - old) starts at 1. Under `fxrewrite.kernels.batch_invariant.batch_invariant_mode()` the
projections run the engine's batch-invariant matmul.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def completion_logprobs(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    micro_batch_size: int = 8,
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """Per sequence, float32 [len(completion)]: log p(completion[t] | prompt + completion[:t]).

    Sequences run in right-padded micro-batches of `micro_batch_size` (attention mask and position ids
    from the padding, so padding changes nothing). Logits are divided by `temperature` first (1.0: the
    engine's raw logprobs). Gradients flow unless called under `torch.no_grad()`. ValueError when the
    two lists differ in length or a prompt is empty.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"got {len(prompts)} prompts and {len(completions)} completions; expected as many")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = next(model.parameters()).device
    out: list[torch.Tensor] = []
    for start in range(0, len(prompts), micro_batch_size):
        batch = [(list(p), list(c)) for p, c in zip(prompts[start:start + micro_batch_size],
                                                   completions[start:start + micro_batch_size])]
        out += _batch_logprobs(model, batch, device, temperature)
    return out


def _batch_logprobs(model, batch, device, temperature: float) -> list[torch.Tensor]:
    lengths = [len(p) + len(c) for p, c in batch]
    width = max(lengths)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, (p, c) in enumerate(batch):
        ids[i, : lengths[i]] = torch.tensor(p + c)
        mask[i, : lengths[i]] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    out = []
    for i, (p, c) in enumerate(batch):
        if not c:
            out.append(torch.zeros(0, device=device))
            continue
        # logits at position t predict token t + 1: the completion's tokens are predicted from len(p) - 1 on
        rows = logits[i, len(p) - 1 : len(p) - 1 + len(c)].float() / temperature
        target = torch.tensor(c, device=device)
        out.append(torch.log_softmax(rows, dim=-1).gather(1, target[:, None]).squeeze(1))
    return out
