"""Tensor-parallel sharding of MoE experts and of full-width q/k norms (called by `fxrewrite.sharding`).

- `shard_experts`: every `FusedExperts` becomes this rank's part: each expert's intermediate columns
  (tensor parallel, the default) or whole experts E/tp (``fxrewrite.distributed.expert_parallel_enabled``);
  `FusedMoE` all-reduces the partial outputs.
- `shard_full_width_norms`: an attention module's RMSNorm whose width is all q heads (or all kv
  heads) times head_dim, as OLMoE's q_norm/k_norm, becomes a `ShardedRMSNorm` over this rank's
  heads with statistics all-reduced over the ranks (transformers computes them over every head).
"""

from __future__ import annotations

from torch import nn

from fxrewrite.data_parallel import moe_parallel
from fxrewrite.layers.fused_moe import FusedExperts
from fxrewrite.layers.layernorm import RMSNorm
from fxrewrite.layers.sharded_norm import ShardedRMSNorm


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def shard_experts(model: nn.Module, tp_rank: int, tp_size: int, plan: dict) -> None:
    """Replace each unsharded `FusedExperts` by this rank's part (filled from the old one unless on meta),
    over `fxrewrite.data_parallel.moe_parallel()`: the TP group, or every worker under DP x EP.

    Raises ValueError when the expert count (EP) or the expert width (TP) does not divide by that size.
    """
    tp_size, tp_rank, ep = moe_parallel(tp_size, tp_rank)
    if tp_size == 1:
        return
    for name, module in list(model.named_modules()):
        if not isinstance(module, FusedExperts) or module.tp_size != 1:
            continue
        old_w13 = module.w13
        new = FusedExperts(module.num_experts, module.hidden_size, module.intermediate_size, tp_size=tp_size,
                           tp_rank=tp_rank, expert_parallel=ep, params_dtype=old_w13.dtype, device=old_w13.device,
                           param_names=module.param_names)
        for old, param in ((module.w13, new.w13), (module.w2, new.w2)):
            if old.device.type != "meta":
                new.weight_loader(param, old.detach())
            param.requires_grad_(old.requires_grad)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
        plan[name] = "expert_parallel" if ep else "experts_colwise"


def shard_full_width_norms(attn: nn.Module, prefix: str, qkv, plan: dict) -> None:
    """Full-width q/k RMSNorms of `attn` (children of the fused `qkv`'s module) -> `ShardedRMSNorm`."""
    d = qkv.head_size
    widths = {qkv.total_num_heads * d: (qkv.q_size, qkv.tp_rank * qkv.q_size, 1)}
    kv_rank = qkv.tp_rank // qkv.num_kv_head_replicas
    widths.setdefault(qkv.total_num_kv_heads * d, (qkv.kv_size, kv_rank * qkv.kv_size, qkv.num_kv_head_replicas))
    for name, child in list(attn.named_children()):
        width = _plain_rms_norm_width(child)
        if width not in widths or width == d:  # not a plain RMSNorm; or per head (Qwen3): no change
            continue
        local, offset, replicas = widths[width]
        new = ShardedRMSNorm(width, local, offset, replicas, child.variance_epsilon,
                             dtype=child.weight.dtype, device=child.weight.device)
        if child.weight.device.type != "meta":
            new.weight_loader(new.weight, child.weight.detach())
        setattr(attn, name, new)
        plan[_join(prefix, name)] = "norm_sharded"


def _plain_rms_norm_width(module: nn.Module) -> int | None:
    """The width of an RMSNorm computing ``w * (x * rsqrt(mean(x²) + eps))`` in float32 (fxrewrite's with
    upcast and no offset, or transformers' OLMoE-style ``*RMSNorm`` left by fusion=False); else None."""
    if type(module) is RMSNorm:
        return module.hidden_size if module.upcast and not module.offset else None
    name, weight = type(module).__name__, getattr(module, "weight", None)
    if (name.endswith("RMSNorm") and "Gemma" not in name and type(module).__module__.startswith("transformers.")
            and hasattr(module, "variance_epsilon") and isinstance(weight, nn.Parameter) and weight.dim() == 1):
        return weight.shape[0]
    return None
