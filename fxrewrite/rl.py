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

from fxrewrite.errors import is_integer
from fxrewrite.kernels.batch_invariant import is_batch_invariant
from fxrewrite.kernels.fused_linear_logprobs import fused_linear_logprobs, fused_linear_token_loss
from fxrewrite.kernels.log_softmax import log_softmax_float32
from fxrewrite.kernels.paged_attention import causal_attention_batch_invariant
from fxrewrite.layers.fold_guard import foreign_forward, global_module_hooks
from fxrewrite.layers.lm_head_loss import LMHeadCrossEntropy

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

    An `fxrewrite.optimize`d model (its `lm_head_loss` proved the logits' transform) skips the logits: the
    base model gives the hidden states, only the completion positions go through the LM head, chunked
    (`fxrewrite.kernels.fused_linear_logprobs`: no [tokens, vocab] tensor, gradients weighted per token);
    other models, and batch-invariant mode (whose head and log_softmax are the engine's kernels), take
    the logits from the model's forward.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"got {len(prompts)} prompts and {len(completions)} completions; expected as many")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    _check_token_ids(model, prompts, completions)
    device = next(model.parameters()).device
    out: list[torch.Tensor] = []
    invariant = is_batch_invariant() and hasattr(getattr(model, "config", None), "_attn_implementation")
    fused = None if is_batch_invariant() else fused_head(model, temperature)
    with attention_implementation(model, register_batch_invariant_attention()) if invariant else nullcontext():
        for start in range(0, len(prompts), micro_batch_size):
            batch = [(list(p), list(c)) for p, c in zip(prompts[start:start + micro_batch_size],
                                                       completions[start:start + micro_batch_size])]
            if fused is not None:
                out += _batch_logprobs_fused(*fused, batch, device)
            else:
                out += _batch_logprobs(model, batch, device, temperature)
    return out


def _check_token_ids(model: nn.Module, prompts, completions) -> None:
    """ValueError naming the sequence and the id for a token id that is not an integer (a float id was read
    as its floor by the fused path) or lies outside the model's embedding rows."""
    for what, seqs in (("prompt", prompts), ("completion", completions)):
        for i, seq in enumerate(seqs):
            if not (_integer_tensor(seq) if isinstance(seq, torch.Tensor) else all(map(_integer_id, seq))):
                bad = seq.dtype if isinstance(seq, torch.Tensor) else next(t for t in seq if not _integer_id(t))
                raise ValueError(f"{what} {i}: token ids must be integers; got {bad!r}")
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is None:
        return
    for what, seqs in (("prompt", prompts), ("completion", completions)):
        for i, seq in enumerate(seqs):
            if len(seq) and (min(seq) < 0 or max(seq) >= rows):  # min / max: C loops, not one per token
                bad = next(t for t in seq if not 0 <= t < rows)
                raise ValueError(f"{what} {i}: token id {bad} is outside the model's vocabulary [0, {rows})")


def fused_head(model: nn.Module, temperature: float = 1.0) -> tuple[nn.Module, nn.Linear, float, float | None] | None:
    """(base model, LM head, scale, softcap) when `model`'s sampled-token logprobs can skip the logits: an
    `fxrewrite.optimize`d causal LM whose `lm_head_loss` proved the logits' transform (scale / soft-cap),
    with a plain `nn.Linear` head over the base model's last hidden state; the temperature folds into the
    scale (not under soft-capping: then None, and the logits path runs). None too when the model (or the PEFT
    wrapper passed) or its head has a forward / backward hook, or a global module hook is set, or one of them a
    forward of its own instance (accelerate's autocast wrapper): this path runs neither, the logits path does. A torch.compile wrapper is looked through
    (the base then runs eagerly); a PEFT model is read through `get_base_model()` when its adapters live inside that
    model's modules (LoRA and the other tuners; prompt learning, whose virtual tokens the PeftModel's own forward
    adds, takes the logits path). None otherwise (fail closed): the base must be the causal LM's own child under
    its `base_model_prefix`."""
    outer = model = getattr(model, "_orig_mod", model)
    if callable(getattr(model, "get_base_model", None)):
        if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", True):
            return None
        model = model.get_base_model()
    loss = model._modules.get("lm_head_loss")
    params = loss.params_for(model) if isinstance(loss, LMHeadCrossEntropy) else None
    head = model._modules.get("lm_head")
    base = model._modules.get(getattr(model, "base_model_prefix", "") or "model")
    if params is None or type(head) is not nn.Linear or not isinstance(base, nn.Module):
        return None
    # this path calls neither the causal LM nor its head: a hook on either (or a global module hook), or a forward
    # put on the head's instance, would not run, and would silently not shape the logprobs (a fresh user's find: a
    # forward hook on lm_head masking tokens to -inf) -- the logits path runs them, as the model's own call does
    # and a forward put on an instance (accelerate's autocast wrapper on the causal LM) is a hook too
    if _user_hooked(outer, model, head) or any(map(foreign_forward, (outer, model, head))):
        return None
    scale, softcap = params
    if softcap and temperature != 1.0:
        return None
    return base, head, scale / temperature, softcap


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _user_hooked(*modules: nn.Module) -> bool:
    """A global forward (pre-)hook is set, or one of `modules` has a forward / backward hook that is not
    fxrewrite's own (`optimize` puts pre-hooks on the causal LM and its base model, and they stay)."""
    if global_module_hooks():
        return True
    return any(not (getattr(hook, "__module__", None) or type(hook).__module__ or "").startswith("fxrewrite.")
               for m in modules for name in _HOOK_DICTS for hook in (m.__dict__.get(name) or {}).values())


def _padded(batch, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and position ids [B, width] of (prompt, completion) pairs."""
    lengths = [len(p) + len(c) for p, c in batch]
    width = max(lengths)
    ids = torch.tensor([p + c + [0] * (width - n) for (p, c), n in zip(batch, lengths)], dtype=torch.long)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _completion_hidden(base, batch, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(last hidden states [N, H] of the positions that predict the completions' N tokens, those tokens [N])."""
    ids, mask, positions = _padded(batch, device)
    hidden = base(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).last_hidden_state
    width = ids.shape[1]
    # hidden state at position t predicts token t + 1: a completion's tokens from len(prompt) - 1 on
    rows = [i * width + len(p) - 1 + j for i, (p, c) in enumerate(batch) for j in range(len(c))]
    target = torch.tensor([t for _, c in batch for t in c], dtype=torch.long)
    rows = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
    # index_select: its backward is one index_add (advanced indexing's is a sorting index_put)
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows), target.to(device, non_blocking=True)


def _batch_logprobs_fused(base, head, scale, softcap, batch, device) -> list[torch.Tensor]:
    hidden, target = _completion_hidden(base, batch, device)
    lps = fused_linear_logprobs(hidden, head.weight, head.bias, target, scale, softcap)
    return list(lps.split([len(c) for _, c in batch]))


def _batch_logprobs(model, batch, device, temperature: float) -> list[torch.Tensor]:
    ids, mask, positions = _padded(batch, device)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    # a model that puts positions of its own first (PEFT prompt tuning's virtual tokens) returns more of them
    offset = logits.shape[1] - ids.shape[1]
    if offset < 0:
        raise ValueError(f"completion_logprobs: the model returned logits for {logits.shape[1]} positions of an input "
                         f"of {ids.shape[1]}; expected at least one per input position")
    out = []
    for i, (p, c) in enumerate(batch):
        if not c:
            out.append(torch.zeros(0, device=device))
            continue
        # logits at position t predict token t + 1: the completion's tokens are predicted from len(p) - 1 on
        rows = logits[i, offset + len(p) - 1 : offset + len(p) - 1 + len(c)].float() / temperature
        target = torch.tensor(c, device=device)
        out.append(log_softmax_float32(rows).gather(1, target[:, None]).squeeze(1))
    return out


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's group-relative advantages (Shao et al., DeepSeekMath, 2024): rewards [N * group_size], the
    `group_size` completions of one prompt adjacent, -> (r - mean of its group) / (std of its group + eps).
    ValueError when group_size is not a positive integer or the length is not a multiple of it."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r}; expected a positive integer (completions per prompt)")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not a multiple of group_size={group_size}")
    groups = rewards.float().view(-1, group_size)
    std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(groups[:, :1])
    return ((groups - groups.mean(dim=1, keepdim=True)) / (std + eps)).view(-1)


def _integer_tensor(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _integer_id(t) -> bool:
    """An int (Python's or numpy's), or a 0-d integer tensor (a list made from a tensor of ids)."""
    return is_integer(t) or (isinstance(t, torch.Tensor) and t.dim() == 0 and _integer_tensor(t))


def grpo_loss(new_logprobs: list[torch.Tensor], old_logprobs: list[torch.Tensor], advantages: torch.Tensor,
              clip_eps: float = 0.2) -> torch.Tensor:
    """The clipped surrogate of PPO/GRPO without a KL term (TRL's default beta=0): per token
    ratio = exp(new - old), loss = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A), averaged over
    every completion token of the batch (DAPO's token-level mean). `old_logprobs`: the engine's
    sampled-token logprobs (no gradient); one tensor [len(completion)] per completion; `advantages` [N],
    one per completion. Computed over the concatenated tokens (a few kernels, whatever N). A batch without
    completion tokens (every rollout ended at once) gives 0, differentiable (no NaN of an empty mean).
    ValueError when the counts or a completion's lengths differ."""
    new_logprobs, old_logprobs = list(new_logprobs), list(old_logprobs)
    if not len(new_logprobs) == len(old_logprobs) == len(advantages):
        raise ValueError(f"{len(new_logprobs)} new logprobs, {len(old_logprobs)} old logprobs and {len(advantages)} "
                         "advantages; expected one each per completion")
    _check_old_lengths([n.numel() for n in new_logprobs], old_logprobs)
    new = torch.cat(new_logprobs)
    if new.numel() == 0:
        return new.sum()
    olds = [o.detach().reshape(-1) for o in old_logprobs]
    if len({o.device for o in olds}) == 1:  # one copy to the device, not one per completion
        old = torch.cat(olds).to(new.device, new.dtype, non_blocking=True)
    else:
        old = torch.cat([o.to(new.device, new.dtype) for o in olds])
    lengths = torch.tensor([n.numel() for n in new_logprobs]).to(new.device, non_blocking=True)
    adv = advantages.to(new.device, new.dtype).repeat_interleave(lengths, output_size=new.numel())
    ratio = torch.exp(new - old)
    return (-torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)).mean()


def _check_old_lengths(lengths: Sequence[int], old_logprobs: Sequence[torch.Tensor]) -> None:
    """ValueError naming the first completion whose old logprobs are not one per token, or not a tensor."""
    for i, (n, o) in enumerate(zip(lengths, old_logprobs)):
        if not isinstance(o, torch.Tensor):
            raise ValueError(f"completion {i}: old logprobs {type(o).__name__} {o!r:.60}; expected a float tensor "
                             "(the engine's, e.g. torch.tensor(logprobs))")
        if n != o.numel():
            raise ValueError(f"completion {i}: {n} new logprobs and {o.numel()} old ones; expected one per "
                             "token of the completion each")


def completion_grpo_loss(model: nn.Module, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                         advantages: torch.Tensor, old_logprobs: list[torch.Tensor] | None = None,
                         clip_eps: float = 0.2, micro_batch_size: int = 8,
                         temperature: float = 1.0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(`grpo_loss` of the completions' logprobs under `model`, those logprobs detached), computed together.

    `old_logprobs`: one float32 [len(completion)] per completion (the engine's), or None for the on-policy
    single step (old = new detached: ratio 1, TRL's GRPO with one optimizer step per generation).
    `advantages` [N]. On an `fxrewrite.optimize`d model (`fused_head`) each micro-batch runs the base model
    and `fxrewrite.kernels.fused_linear_logprobs.fused_linear_token_loss`, which makes the LM head's gradients
    in the forward with the loss's per-token derivative: the backward does not recompute the logits (three
    LM-head GEMMs per chunk instead of four; each micro-batch holds its d weight [V, H] until the backward, so
    call it once per backward with one micro-batch, as `fxrewrite bench rl` does). Same numbers as `grpo_loss(completion_logprobs(...), ...)`,
    which the other models (and batch-invariant mode) run. ValueErrors as `completion_logprobs`, and when
    `advantages` or `old_logprobs` do not have one entry per completion."""
    if len(advantages) != len(completions) or (old_logprobs is not None and len(old_logprobs) != len(completions)):
        raise ValueError(f"{len(completions)} completions, {len(advantages)} advantages and "
                         f"{'no' if old_logprobs is None else len(old_logprobs)} old logprobs; expected one each")
    total = sum(len(c) for c in completions)
    fused = None if is_batch_invariant() else fused_head(model, temperature)
    if fused is None or total == 0:
        new = completion_logprobs(model, prompts, completions, micro_batch_size, temperature)
        olds = [n.detach() for n in new] if old_logprobs is None else old_logprobs
        return grpo_loss(new, olds, advantages, clip_eps), [n.detach() for n in new]
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    _check_token_ids(model, prompts, completions)  # as completion_logprobs does (an id past the vocabulary)
    device = next(model.parameters()).device
    lengths = [len(c) for c in completions]
    if old_logprobs is not None:  # before the join: offsets into it would silently shift (a fresh user's find)
        _check_old_lengths(lengths, old_logprobs)
    adv = advantages.to(device, torch.float32).repeat_interleave(torch.tensor(lengths).to(device), output_size=total)
    old = None if old_logprobs is None else torch.cat([o.detach().reshape(-1).float() for o in old_logprobs]).to(device)
    loss, out, offset = None, [], 0
    for start in range(0, len(prompts), micro_batch_size):
        batch = [(list(p), list(c)) for p, c in zip(prompts[start:start + micro_batch_size],
                                                   completions[start:start + micro_batch_size])]
        hidden, target = _completion_hidden(fused[0], batch, device)
        n = target.numel()
        token_loss = _grpo_token_loss(None if old is None else old[offset:offset + n], adv[offset:offset + n],
                                      clip_eps, total)
        part, lps = fused_linear_token_loss(hidden, fused[1].weight, fused[1].bias, target, token_loss, *fused[2:])
        loss = part if loss is None else loss + part
        out += list(lps.split([len(c) for _, c in batch]))
        offset += n
    return loss, out


def _grpo_token_loss(old: torch.Tensor | None, adv: torch.Tensor, clip_eps: float, total: int):
    """`grpo_loss`'s per-token term over `total` tokens, as `fused_linear_token_loss`'s token_loss."""
    def token_loss(lp: torch.Tensor, s: int, e: int) -> torch.Tensor:
        ratio = torch.exp(lp - (lp.detach() if old is None else old[s:e]))
        a = adv[s:e]
        return -torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a) / total
    return token_loss
