"""Tensor-parallel sharding of MoE experts and of full-width q/k norms (called by `fxrewrite.sharding`).

- `shard_experts`: every `FusedExperts` becomes this rank's part: each expert's intermediate columns
  (tensor parallel, the default) or whole experts E/tp (``fxrewrite.distributed.expert_parallel_enabled``);
  `FusedMoE` all-reduces the partial outputs.
- `shard_transformers_experts`: transformers' own experts modules that the moe pattern left (GPT-OSS's, or any with
  fusion off) keep whole experts E/tp on each rank; the routing is masked to them and the output all-reduced.
- `shard_full_width_norms`: an attention module's RMSNorm whose width is all q heads (or all kv
  heads) times head_dim, as OLMoE's q_norm/k_norm, becomes a `ShardedRMSNorm` over this rank's
  heads with statistics all-reduced over the ranks (transformers computes them over every head).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from fxrewrite.data_parallel import dp_ep_active, moe_parallel
from fxrewrite.distributed import tensor_model_parallel_all_reduce
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


def shard_transformers_experts(model: nn.Module, tp_rank: int, tp_size: int, plan: dict) -> None:
    """transformers' experts modules (classes under ``@use_experts_implementation``: ``forward(hidden_states,
    top_k_index, top_k_weights)``, every parameter [num_experts, ...]) that fusion left: rank r keeps experts
    [r*E/tp, (r+1)*E/tp) whole, whatever their layout (interleaved gate/up, biases, transposed).

    A forward pre-hook maps the routed ids to local ones and zeroes the weights of slots routed elsewhere (sent to
    local expert 0, whose output they then scale by 0: transformers' eager experts accept no out-of-range id), a
    forward hook sums the partial outputs over the TP ranks. Left replicated (still correct): E not divisible by
    tp_size, and data parallel x expert parallel, whose ranks hold different tokens.
    """
    if tp_size == 1 or dp_ep_active():
        return
    for name, module in list(model.named_modules()):
        num_experts = _transformers_experts_count(module)
        if num_experts is None or num_experts % tp_size:
            continue
        local = num_experts // tp_size
        for pname, old in list(module.named_parameters(recurse=False)):
            new = nn.Parameter(torch.empty((local, *old.shape[1:]), dtype=old.dtype, device=old.device),
                               requires_grad=old.requires_grad)
            new.weight_loader = _ExpertsLoader(tp_rank * local, local, num_experts)
            if old.device.type != "meta":
                new.weight_loader(new, old.detach())
            setattr(module, pname, new)
        module.num_experts, module.global_num_experts = local, num_experts  # vLLM's name for the checkpoint's count
        module.register_forward_pre_hook(_LocalRouting(module, tp_rank * local, local), with_kwargs=True)
        module.register_forward_hook(_SumOverRanks())
        plan[name] = "experts_whole"


def _transformers_experts_count(module: nn.Module) -> int | None:
    """E for a transformers experts module (flags `use_experts_implementation` sets, an int `num_experts`, every
    direct parameter's first dimension E, children without parameters: activations); else None."""
    num_experts = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    if (type(module).__module__.startswith("transformers.") and hasattr(module, "is_transposed")
            and hasattr(module, "has_gate") and isinstance(num_experts, int) and num_experts > 1 and params
            and all(p.dim() >= 2 and p.shape[0] == num_experts for p in params)
            and not any(True for c in module.children() for _ in c.parameters())):
        return num_experts
    return None


class _ExpertsLoader:
    """weight_loader of a rank's experts: rows [first, first + count) of the full [E, ...] tensor."""

    def __init__(self, first: int, count: int, total: int):
        self.first, self.count, self.total = first, count, total

    def full_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        """The checkpoint's shape of `param`: all the experts (what in-place weight sync sends)."""
        return (self.total, *param.shape[1:])

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, loaded_shard_id=None) -> None:
        if tuple(loaded.shape) != (self.total, *param.shape[1:]):
            raise ValueError(f"experts weight shape {tuple(loaded.shape)} does not match "
                             f"{(self.total, *param.shape[1:])} (this rank holds {self.count} of its {self.total} experts)")
        if param.device.type != "meta":
            with torch.no_grad():
                param.copy_(loaded.narrow(0, self.first, self.count))


class _LocalRouting:
    """Forward pre-hook: global expert ids -> this rank's ([first, first + count) -> [0, count)); the weights of
    slots routed to other ranks' experts -> 0 (their id -> 0). The three inputs go on positionally: the experts
    implementations transformers dispatches to name them differently from the module's own forward."""

    def __init__(self, module: nn.Module, first: int, count: int):
        self.first, self.count = first, count
        self.names = list(inspect.signature(type(module).forward).parameters)[1:4]  # hidden, ids, weights

    def __call__(self, module, args, kwargs):
        kwargs = dict(kwargs)
        hidden, ids, weights = list(args[:3]) + [kwargs.pop(n) for n in self.names[len(args):]]
        local = ids - self.first
        mine = (local >= 0) & (local < self.count)
        return (hidden, torch.where(mine, local, torch.zeros_like(local)), weights * mine.to(weights.dtype),
                *args[3:]), kwargs


class _SumOverRanks:
    """Forward hook: the experts' partial output (this rank's experts only) summed over the TP ranks."""

    def __call__(self, module, args, output):
        return tensor_model_parallel_all_reduce(output)


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
