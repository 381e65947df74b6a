"""Tensor-parallel sharding of MoE experts and of full-width q/k norms (called by `fxrewrite.sharding`).

- `shard_experts`: every `FusedExperts` becomes this rank's part: each expert's intermediate columns
  (tensor parallel, the default) or whole experts E/tp (``fxrewrite.distributed.expert_parallel_enabled``);
  `FusedMoE` all-reduces the partial outputs.
- `shard_transformers_experts`: transformers' own experts modules that the moe pattern left (GPT-OSS's, or any with
  fusion off) keep whole experts E/tp on each rank; the routing is masked to them and the output all-reduced.
  Under data parallel x expert parallel, E/(dp x tp) on each worker, the replicas' inputs gathered as
  `fxrewrite.layers.moe_dp` does for `FusedMoE` (`ExpertsAcrossReplicas`).
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
from fxrewrite.layers import moe_dp
from fxrewrite.layers.fused_moe import FusedExperts
from fxrewrite.layers.layernorm import plain_rms_norm_width
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
        new.keep_children(module.kept_children())
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
        plan[name] = "expert_parallel" if ep else "experts_colwise"


def shard_transformers_experts(model: nn.Module, tp_rank: int, tp_size: int, plan: dict) -> None:
    """transformers' experts modules (classes under ``@use_experts_implementation``: ``forward(hidden_states,
    top_k_index, top_k_weights)``, every parameter [num_experts, ...]) that fusion left: EP rank r of n (the TP
    group, or every worker under data parallel x expert parallel: `moe_parallel`) keeps experts [r*E/n, (r+1)*E/n)
    whole, whatever their layout (interleaved gate/up, biases, transposed).

    A forward pre-hook maps the routed ids to local ones and zeroes the weights of slots routed elsewhere (sent to
    local expert 0, whose output they then scale by 0: transformers' eager experts accept no out-of-range id), a
    forward hook sums the partial outputs over the TP ranks. Under DP x EP the replicas hold different tokens: a
    first pre-hook gathers every replica's inputs and the forward hook hands each replica its rows summed over every
    worker (`ExpertsAcrossReplicas`). Left replicated (still correct): E not divisible by n.
    """
    size, rank, _ = moe_parallel(tp_size, tp_rank)
    if size == 1:
        return
    across_replicas = dp_ep_active()
    text_config = _text_config(model)
    for name, module in list(model.named_modules()):
        num_experts = _transformers_experts_count(module)
        if num_experts is None or num_experts % size:
            continue
        local = num_experts // size
        for pname, old in list(module.named_parameters(recurse=False)):
            new = nn.Parameter(torch.empty((local, *old.shape[1:]), dtype=old.dtype, device=old.device),
                               requires_grad=old.requires_grad)
            new.weight_loader = _ExpertsLoader(rank * local, local, num_experts)
            if old.device.type != "meta":
                new.weight_loader(new, old.detach())
            setattr(module, pname, new)
        module.num_experts, module.global_num_experts = local, num_experts  # vLLM's name for the checkpoint's count
        summed = _SumOverRanks()
        if across_replicas:  # registered first: the local routing below sees every replica's rows
            summed = ExpertsAcrossReplicas(module, getattr(text_config, "hidden_size", None),
                                           getattr(text_config, "num_experts_per_tok", None))
            module.register_forward_pre_hook(summed.gather, with_kwargs=True)
            module.__dict__[_ACROSS_REPLICAS] = summed
        module.register_forward_pre_hook(_LocalRouting(module, rank * local, local), with_kwargs=True)
        module.register_forward_hook(summed)
        plan[name] = "experts_whole"


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


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
                             f"{(self.total, *param.shape[1:])} (this rank holds {self.count} of its {self.total} "
                             "experts)")
        if param.device.type != "meta":
            with torch.no_grad():
                param.copy_(loaded.narrow(0, self.first, self.count))


def _input_names(module: nn.Module) -> list[str]:
    """The names of `module.forward`'s three inputs (hidden, ids, weights)."""
    return list(inspect.signature(type(module).forward).parameters)[1:4]


def _positional(names: list[str], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """(args, kwargs) with the three inputs moved to the first three positions of args."""
    kwargs = dict(kwargs)
    return tuple(args[:3]) + tuple(kwargs.pop(n) for n in names[len(args):]) + tuple(args[3:]), kwargs


class _LocalRouting:
    """Forward pre-hook: global expert ids -> this rank's ([first, first + count) -> [0, count)); the weights of
    slots routed to other ranks' experts -> 0 (their id -> 0; a padding row's id -1 too). The three inputs go on
    positionally: the experts implementations transformers dispatches to name them differently from the module's
    own forward."""

    def __init__(self, module: nn.Module, first: int, count: int):
        self.first, self.count = first, count
        self.names = _input_names(module)

    def __call__(self, module, args, kwargs):
        (hidden, ids, weights, *rest), kwargs = _positional(self.names, args, kwargs)
        local = ids - self.first
        mine = (local >= 0) & (local < self.count)
        return (hidden, torch.where(mine, local, torch.zeros_like(local)), weights * mine.to(weights.dtype),
                *rest), kwargs


_ACROSS_REPLICAS = "_fxrewrite_experts_across_replicas"


def experts_across_replicas(module: nn.Module) -> ExpertsAcrossReplicas | None:
    """The hooks that split `module` (a transformers experts module) over every DP x EP worker, else None."""
    return module.__dict__.get(_ACROSS_REPLICAS)


class ExpertsAcrossReplicas:
    """Hooks of a transformers experts module whose experts are split over every DP x EP worker
    (`fxrewrite.layers.moe_dp`'s steps, the router having run on the replica's own tokens):
    `gather` (forward pre-hook) all-gathers hidden [T, H], top-k ids [T, k] (int64) and top-k weights [T, k] over
    the DP group, each replica's rows padded to the largest replica's count (padding routed nowhere: id -1); the
    hook itself (forward hook) returns this replica's T rows of the output summed over every worker
    (reduce-scatter over DP, all-reduce over TP). `run_idle` takes part with zero rows (a replica without work).
    Every replica must call the module at the same points; RuntimeError when the step's announced token count
    differs from T (`moe_dp.token_counts`)."""

    def __init__(self, module: nn.Module, hidden_size: int | None, top_k: int | None):
        self.names = _input_names(module)
        dtype = next(module.parameters()).dtype
        self.inputs = (hidden_size, top_k, dtype, dtype)
        """(H, k, hidden dtype, weights dtype) of the last call (from the config until then): `run_idle`'s."""
        self.call = None  # (T, original hidden shape, whether the replicas met) of the call under way

    def gather(self, module, args, kwargs):
        (hidden, ids, weights, *rest), kwargs = _positional(self.names, args, kwargs)
        shape, top_k = hidden.shape, ids.shape[-1]
        hidden, ids, weights = hidden.reshape(-1, shape[-1]), ids.reshape(-1, top_k), weights.reshape(-1, top_k)
        self.inputs = (shape[-1], top_k, hidden.dtype, weights.dtype)
        counts = moe_dp.replica_counts(hidden.shape[0], hidden.device)
        self.call = (hidden.shape[0], shape, max(counts) > 0)
        if max(counts) == 0:  # no replica has tokens: every one skips the collectives
            return (hidden, ids, weights, *rest), kwargs
        # ids and weights travel as int64 / float32: the same on every replica, an idle one included
        gathered = (moe_dp.gather_rows(hidden, counts), moe_dp.gather_rows(ids.long(), counts, pad_value=-1),
                    moe_dp.gather_rows(weights.float(), counts).to(weights.dtype))
        return (*gathered, *rest), kwargs

    def __call__(self, module, args, output):
        num_tokens, shape, met = self.call
        self.call = None
        return (moe_dp.sum_to_replica(output, num_tokens) if met else output).reshape(shape)

    @torch.inference_mode()
    def run_idle(self, module: nn.Module) -> None:
        """Call `module` with zero rows (this replica has no tokens this step); RuntimeError when H or k is
        unknown (no call yet, and the config names neither ``hidden_size`` nor ``num_experts_per_tok``)."""
        hidden_size, top_k, hidden_dtype, weights_dtype = self.inputs
        if hidden_size is None or top_k is None:
            raise RuntimeError(f"{type(module).__name__}: hidden size or top-k unknown for an idle replica's call")
        device = next(module.parameters()).device
        module(torch.empty(0, hidden_size, dtype=hidden_dtype, device=device),
               torch.empty(0, top_k, dtype=torch.int64, device=device),
               torch.empty(0, top_k, dtype=weights_dtype, device=device))


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
        width = plain_rms_norm_width(child)
        if width not in widths or width == d:  # not a plain RMSNorm; or per head (Qwen3): no change
            continue
        local, offset, replicas = widths[width]
        new = ShardedRMSNorm(width, local, offset, replicas, child.variance_epsilon,
                             dtype=child.weight.dtype, device=child.weight.device)
        if child.weight.device.type != "meta":
            new.weight_loader(new.weight, child.weight.detach())
        setattr(attn, name, new)
        plan[_join(prefix, name)] = "norm_sharded"
