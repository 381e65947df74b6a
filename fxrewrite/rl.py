"""Trainer-side helpers for RL loops that sample with the engine (`fxrewrite.LLM`).

`completion_logprobs(model, prompts, completions)` recomputes, with gradients, the log-probabilities
of sampled tokens under a causal LM (stock or `fxrewrite.optimize`d): the numbers the engine reports
with `SamplingParams(logprobs=0)` (log-softmax of the raw logits, float32), so that a GRPO/PPO ratio
exp(new - old) starts at 1. Under `fxrewrite.kernels.batch_invariant.batch_invariant_mode()` every op
runs what the engine's `batch_invariant=True` steps run: the projections its fixed-tile matmul, the
log_softmax its per-row kernel, and the attention (switched for the call to the "fxrewrite_batch_invariant"
implementation registered here in transformers' `AttentionInterface`) its one paged kernel, so on a GPU
the recomputed logprobs of an optimized model equal the engine's (`model_impl="transformers"`) bitwise.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Sequence

import torch
from torch import nn

from fxrewrite.kernels.batch_invariant import is_batch_invariant
from fxrewrite.kernels.paged_attention import causal_attention_batch_invariant

BATCH_INVARIANT_ATTENTION = "fxrewrite_batch_invariant"


def batch_invariant_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                      attention_mask: torch.Tensor | None, scaling: float | None = None,
                                      dropout: float = 0.0, sliding_window: int | None = None,
                                      softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, Hq, L, D], key/value [B, Hkv, L, D] ->
    ([B, L, Hq, D], None), causal, rows right-padded (transformers passes no mask for this name:
    `causal_attention_batch_invariant`). ValueError for dropout (the engine has none)."""
    if dropout:
        raise ValueError(f"{BATCH_INVARIANT_ATTENTION} attention has no dropout, got dropout={dropout}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    return causal_attention_batch_invariant(query, key, value, scale, window, softcap), None


def register_batch_invariant_attention() -> str:
    """Register "fxrewrite_batch_invariant" in transformers' attention registry (idempotent); returns it."""
    from transformers import AttentionInterface

    AttentionInterface.register(BATCH_INVARIANT_ATTENTION, batch_invariant_attention_forward)
    return BATCH_INVARIANT_ATTENTION


@contextmanager
def attention_implementation(model: nn.Module, name: str):
    """Run the block with `model` (a transformers PreTrainedModel) attending through `name`, then restore."""
    config = model.config
    previous = config._attn_implementation
    if previous == name:
        yield
        return
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


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
    two lists differ in length or a prompt is empty. Inside `batch_invariant_mode()` the model (a
    transformers one) attends through "fxrewrite_batch_invariant" for the call (see the module docstring).
    """
    if len(prompts) != len(completions):
        raise ValueError(f"got {len(prompts)} prompts and {len(completions)} completions; expected as many")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = next(model.parameters()).device
    out: list[torch.Tensor] = []
    invariant = is_batch_invariant() and hasattr(getattr(model, "config", None), "_attn_implementation")
    with attention_implementation(model, register_batch_invariant_attention()) if invariant else nullcontext():
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
