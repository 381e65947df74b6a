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


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's group-relative advantages (Shao et al., DeepSeekMath, 2024): rewards [N * group_size], the
    `group_size` completions of one prompt adjacent, -> (r - mean of its group) / (std of its group + eps).
    ValueError when the length is not a multiple of group_size."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not a multiple of group_size={group_size}")
    groups = rewards.float().view(-1, group_size)
    std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(groups[:, :1])
    return ((groups - groups.mean(dim=1, keepdim=True)) / (std + eps)).view(-1)


def grpo_loss(new_logprobs: list[torch.Tensor], old_logprobs: list[torch.Tensor], advantages: torch.Tensor,
              clip_eps: float = 0.2) -> torch.Tensor:
    """The clipped surrogate of PPO/GRPO without a KL term (TRL's default beta=0): per token
    ratio = exp(new - old), loss = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A), averaged over
    every completion token of the batch (DAPO's token-level mean). `old_logprobs`: the engine's
    sampled-token logprobs (no gradient); one tensor [len(completion)] per completion."""
    per_token = []
    for new, old, adv in zip(new_logprobs, old_logprobs, advantages):
        ratio = torch.exp(new - old.to(new.device))
        clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps)
        per_token.append(-torch.minimum(ratio * adv, clipped * adv))
    return torch.cat(per_token).mean()
