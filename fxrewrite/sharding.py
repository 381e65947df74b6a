"""Tensor-parallel sharding of an optimized transformers model, read off the fusion (post-hoc transform).

`shard_model(model, tp_rank, tp_size)` mutates a model already passed through `fxrewrite.optimize`
(parameters on meta, as the engine builds it, or real: then each new layer is filled from the old
one through its `weight_loader`). The plan, in order:
1. MoE experts (`fxrewrite.sharding_moe`; at tp 1 too under data parallel x expert parallel, over all dp x tp
   workers): `FusedExperts` by columns or whole experts, transformers' own experts modules the fusion left
   whole, E/tp per rank (E/(dp x tp) under DP x EP);
2. fusion: every fused `QKVParallelLinear` becomes column-parallel by heads (kv heads replicated
   when fewer than ranks) and forces its output projection row-parallel; every fused gate/up
   `MergedColumnParallelLinear` forces the down projection row-parallel. The partner is read off the
   match: the fused layer's `row_partner`, the one linear its outputs reach in the traced graph through
   operations proven to keep heads (features) apart (`fxrewrite.patterns.feature_path`); none, several, one
   not proven, or one not reading the fused width: UnsupportedModelError with the reason (fail closed).
3. the config's `base_model_tp_plan` ("colwise" / "rowwise") for plain linears the fusion left;
4. the input embedding and LM head become `VocabParallelEmbedding` / `ParallelLMHead` (ties kept);
5. anything else stays replicated.
Attention modules need no edit: transformers infers heads from the projection width
(``view(*shape, -1, head_dim)``) and the paged attention reads Hq / Hkv from the tensors.

`LazySlice` wraps a safetensors ``get_slice`` handle: the weight loaders `narrow` it to their
rank's rows and only those bytes are read (`fxrewrite.runtime.model_files.loader.iterate_safetensors(sliced=True)`).
"""

from __future__ import annotations

import dataclasses

import fnmatch

import torch
from torch import nn
from torch.utils._pytree import tree_map

from fxrewrite.errors import UnsupportedModelError, UserInputError
from fxrewrite.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from fxrewrite.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from fxrewrite.sharding_moe import shard_experts, shard_full_width_norms, shard_transformers_experts
from fxrewrite.patterns.base import PREFUSED_ATTR
from fxrewrite.weights import SHARDS_ATTR

_COLWISE = ("colwise", "local_colwise")
_ROWWISE = ("rowwise", "local_rowwise")


def shard_model(model: nn.Module, tp_rank: int, tp_size: int) -> dict[str, str]:
    """Shard `model` in place for rank `tp_rank` of `tp_size`; returns {module name: style}.

    Styles: "qkv" / "merged" (fused, column), "colwise", "rowwise", "vocab". Raises ValueError when
    a fused layer's partner cannot be found or a size does not divide by tp_size.
    """
    plan: dict[str, str] = {}
    # MoE: experts' columns, or whole experts (EP; also at tp 1 under DP x EP)
    shard_experts(model, tp_rank, tp_size, plan)
    shard_transformers_experts(model, tp_rank, tp_size, plan)  # transformers' experts: whole ones (same rule)
    if tp_size == 1:
        return plan
    modules = dict(model.named_modules())
    for prefix, module in list(modules.items()):
        for new, _ in module.__dict__.get(SHARDS_ATTR, ()):
            _shard_fused(module, prefix, new, tp_rank, tp_size, plan)
        for kind, name, facts in module.__dict__.get(PREFUSED_ATTR, ()):
            _shard_prefused(module, prefix, kind, name, facts, tp_rank, tp_size, plan)
    _apply_tp_plan(model, tp_rank, tp_size, plan)
    _shard_vocab(model, tp_rank, tp_size, plan)
    return plan


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _replace(parent: nn.Module, name: str, new: nn.Module, old: nn.Module) -> None:
    """Put `new` in `parent.name`; fill it from `old` (full tensors) unless `old` is on meta."""
    old_params = dict(old.named_parameters(recurse=False))
    for pname, param in new.named_parameters(recurse=False):
        src = old_params.get(pname)
        if src is not None and src.device.type != "meta":
            param.weight_loader(param, src.detach())
        if src is not None:
            param.requires_grad_(src.requires_grad)
    setattr(parent, name, new)


def _factory(old: nn.Module) -> dict:
    return {"params_dtype": old.weight.dtype, "device": old.weight.device}


def _shard_fused(module: nn.Module, prefix: str, name: str, tp_rank: int, tp_size: int, plan: dict) -> None:
    fused = getattr(module, name)
    tp = {"tp_size": tp_size, "tp_rank": tp_rank}
    bias = fused.bias is not None
    if isinstance(fused, QKVParallelLinear):
        new = QKVParallelLinear(fused.input_size, fused.head_size, fused.total_num_heads, fused.total_num_kv_heads,
                                bias=bias, **tp, **_factory(fused))
        width, style = fused.total_num_heads * fused.head_size, "qkv"
    elif isinstance(fused, MergedColumnParallelLinear):
        new = MergedColumnParallelLinear(fused.input_size, fused.output_sizes, bias=bias, **tp, **_factory(fused))
        width, style = fused.output_sizes[0], "merged"
    else:
        return
    _shard_column_pair(module, prefix, name, fused, new, (fused.row_partner, fused.row_partner_why), width, style,
                       plan)


def _shard_prefused(module: nn.Module, prefix: str, kind: str, name: str, facts: dict, tp_rank: int, tp_size: int,
                    plan: dict) -> None:
    """A projection the model ships fused (Phi-3's ``qkv_proj`` [q | k | v], ``gate_up_proj`` [gate | up]), proven
    by its pattern (`PREFUSED_ATTR`) -> this rank's heads / halves, its row partner row-parallel; the qkv split sizes
    the rewritten forward reads become this rank's. The checkpoint's whole fused tensor loads through the new
    layer's `weight_loader` (shard id None). Without one nn.Linear partner reading `width` features (or where the
    projection is no plain nn.Linear any more) it stays whole, as before this rule: the base_model_tp_plan and the
    engine's check of each rank's attention heads then decide."""
    old = getattr(module, name)
    width = facts["num_heads"] * facts["head_size"] if kind == "qkv" else facts["sizes"][0]
    partner = getattr(module, facts["row_partner"], None) if facts["row_partner"] else None
    if type(old) is not nn.Linear or type(partner) is not nn.Linear or partner.in_features != width:
        return
    tp = {"tp_size": tp_size, "tp_rank": tp_rank, **_factory(old)}
    bias = old.bias is not None
    if kind == "qkv":
        new = QKVParallelLinear(old.in_features, facts["head_size"], facts["num_heads"], facts["num_kv_heads"],
                                bias=bias, **tp)
    else:
        new = MergedColumnParallelLinear(old.in_features, facts["sizes"], bias=bias, **tp)
    _shard_column_pair(module, prefix, name, old, new, (facts["row_partner"], facts.get("row_partner_why")), width,
                       kind, plan)
    if kind == "qkv":
        setattr(module, facts["sizes_attr"], list(new.output_sizes))


def _shard_column_pair(module: nn.Module, prefix: str, name: str, old: nn.Module, new: nn.Module,
                       partner_found: tuple[str | None, str | None], width: int, style: str, plan: dict) -> None:
    """Put the column-parallel `new` in place of `old` and make its row partner (name, or None and why) row-parallel."""
    partner = _row_partner(module, prefix, name, *partner_found, width)
    new.row_partner = partner
    _replace(module, name, new, old)
    if style == "qkv":
        shard_full_width_norms(module, prefix, new, plan)  # OLMoE: one norm over all heads of q / of k
        _set_rank_head_counts(module, prefix, new)
    plan[_join(prefix, name)] = style
    old_partner = getattr(module, partner)
    row = RowParallelLinear(old_partner.in_features, old_partner.out_features, bias=old_partner.bias is not None,
                            tp_size=new.tp_size, tp_rank=new.tp_rank, **_factory(old_partner))
    _replace(module, partner, row, old_partner)
    plan[_join(prefix, partner)] = "rowwise"


_HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")


def _set_rank_head_counts(attn: nn.Module, prefix: str, new: QKVParallelLinear) -> None:
    """Give the attention module this rank's head counts where it reshapes by its own (OPT's and StableLM's
    ``view(bsz, len, self.num_heads, self.head_dim)``; before, a view error at load), and the matching
    `num_key_value_groups`. UnsupportedModelError where a descendant holds one module per head (StableLM's per-head
    q / k LayerNorms): it would pair this rank's heads with the first heads' modules."""
    for name, child in attn.named_modules():
        if isinstance(child, nn.ModuleList) and len(child) in (new.total_num_heads, new.total_num_kv_heads):
            raise UnsupportedModelError(
                f"cannot shard {prefix or type(attn).__name__}: its {name} holds one module per head, which "
                "fxrewrite does not split across ranks, so this model cannot run at tensor_parallel_size > 1")
    counts = {new.total_num_kv_heads: new.num_kv_heads, new.total_num_heads: new.num_heads}
    for attr in _HEAD_COUNT_ATTRS:
        value = attn.__dict__.get(attr)
        if isinstance(value, int) and value in counts:
            setattr(attn, attr, counts[value])
    if isinstance(attn.__dict__.get("num_key_value_groups"), int):
        attn.num_key_value_groups = new.num_heads // new.num_kv_heads


def _row_partner(module: nn.Module, prefix: str, fused_name: str, name: str | None, why: str | None,
                 width: int) -> str:
    """The fused layer's row partner `name` (the linear its outputs reach head by head, or None and `why` not),
    checked: a plain nn.Linear child reading `width` features, what one branch of the fused layer produces."""
    child = getattr(module, name, None) if name else None
    if type(child) is not nn.Linear or child.in_features != width:
        where = prefix or type(module).__name__
        found = f"{name!r} ({type(child).__name__})" if name else f"no proven row partner ({why})" if why \
            else "no single linear"
        raise UnsupportedModelError(
            f"cannot shard {where}.{fused_name}: among the children of {type(module).__name__} its outputs reach "
            f"{found} (the traced graph of that module); row-parallel sharding needs them to reach one nn.Linear "
            f"child reading {width} features, each head (feature) apart, so this model cannot run at "
            "tensor_parallel_size > 1")
    return name


def _apply_tp_plan(model: nn.Module, tp_rank: int, tp_size: int, plan: dict) -> None:
    """`base_model_tp_plan` ("colwise"/"rowwise") for plain nn.Linear modules the fusion left."""
    config = getattr(model, "config", None)
    base = getattr(model, "base_model", model)
    tp_plan = getattr(config, "base_model_tp_plan", None) or {}
    base_prefix = next((n for n, m in model.named_modules() if m is base), "")
    head_dim = getattr(config, "head_dim", None)
    attention: list[tuple[nn.Module, str]] = []
    for name, module in list(base.named_modules()):
        full = _join(base_prefix, name)
        style = next((s for pat, s in tp_plan.items() if fnmatch.fnmatchcase(name, pat)), None)
        parent_name, _, child = name.rpartition(".")
        parent = base.get_submodule(parent_name)
        style = _head_sharded_style(style, child, parent)
        if full in plan or type(module) is not nn.Linear or style not in _COLWISE + _ROWWISE:
            continue
        tp = {"tp_size": tp_size, "tp_rank": tp_rank, **_factory(module)}
        if style in _COLWISE:
            if head_dim and module.out_features % head_dim == 0 and (module.out_features // head_dim) % tp_size:
                raise UserInputError(f"cannot shard {full} column-wise: {module.out_features // head_dim} heads "
                                     f"over tp_size={tp_size} (enable fusion to replicate kv heads)")
            new = ColumnParallelLinear(module.in_features, module.out_features, module.bias is not None, **tp)
        else:
            new = RowParallelLinear(module.in_features, module.out_features, module.bias is not None, **tp)
        _replace(parent, child, new, module)
        plan[full] = "colwise" if style in _COLWISE else "rowwise"
        # full-width q/k norms sit between separate q/k projections and attention (an MLA latent norm is not one)
        if child == "q_proj" and style in _COLWISE and all(hasattr(parent, n) for n in ("k_proj", "v_proj")):
            attention.append((parent, _join(base_prefix, parent_name)))
    for parent, prefix in attention:  # OLMoE-style norms over all heads: statistics over every rank
        shard_full_width_norms(parent, prefix, _HeadLayout.of(parent, config, tp_rank, tp_size), plan)
    _refuse_sharded_parameters(base, base_prefix, tp_plan, plan)


# Per-head parameters the serving engine's paged attention narrows to the rank's heads at each call (attention sinks:
# GraniteSWA's plan splits them, GPT-OSS's keeps them whole).
_SLICED_AT_CALL = ("sinks", "s_aux")


def _refuse_sharded_parameters(base: nn.Module, base_prefix: str, tp_plan: dict, plan: dict) -> None:
    """UnsupportedModelError where the plan splits a bare parameter of a module not sharded here (Beam's per-head
    `gate_bias`, "colwise"): a whole parameter beside sharded heads would not broadcast."""
    for name, _ in base.named_parameters():
        style = next((s for pat, s in tp_plan.items() if fnmatch.fnmatchcase(name, pat)), None)
        owner, _, leaf = name.rpartition(".")
        if style in _COLWISE + _ROWWISE and _join(base_prefix, owner) not in plan and leaf not in _SLICED_AT_CALL:
            raise UnsupportedModelError(
                f"the model's tensor-parallel plan splits the parameter {name} ({style!r}), which fxrewrite does not "
                "shard (linear layers only), so this model cannot run at tensor_parallel_size > 1")


def _head_sharded_style(style: str | None, child: str, parent: nn.Module) -> str | None:
    """transformers' "colwise_gather_output" q/k/v and "rowwise_split_input" o_proj (OLMoE, Olmo2...: a norm
    over all heads sits between) as plain head sharding: attention is per head, and the full-width norms
    become `ShardedRMSNorm`s. Also where the plan names no style for them (GPT-OSS's plan lists none: its attention
    stayed whole on every rank while the KV cache holds the rank's heads). Only for separate q/k/v/o projections;
    anything else stays unsharded."""
    separate = all(type(getattr(parent, n, None)) in (nn.Linear, ColumnParallelLinear, RowParallelLinear)
                   for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    if style in ("colwise_gather_output", None) and separate and child in ("q_proj", "k_proj", "v_proj"):
        return "colwise"
    if style in ("rowwise_split_input", None) and separate and child == "o_proj":
        return "rowwise"
    return style


@dataclasses.dataclass
class _HeadLayout:
    """What `shard_full_width_norms` reads of a fused QKV layer, for separate q/k/v projections."""

    head_size: int
    total_num_heads: int
    total_num_kv_heads: int
    tp_rank: int
    tp_size: int
    num_kv_head_replicas: int = 1

    @classmethod
    def of(cls, attn: nn.Module, config, tp_rank: int, tp_size: int) -> _HeadLayout:
        heads = config.num_attention_heads
        d = getattr(attn, "head_dim", None) or getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(d, heads, getattr(config, "num_key_value_heads", None) or heads, tp_rank, tp_size)

    @property
    def q_size(self) -> int:
        return self.total_num_heads * self.head_size // self.tp_size

    @property
    def kv_size(self) -> int:
        return self.total_num_kv_heads * self.head_size // self.tp_size


def _shard_vocab(model: nn.Module, tp_rank: int, tp_size: int, plan: dict) -> None:
    """Input embedding -> VocabParallelEmbedding, LM head -> ParallelLMHead (plain ones only; a head tied to an
    embedding of another class, BioGPT's scaled one, stays whole with it, so the tie holds)."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    embed, head = (get_in() if get_in else None), (get_out() if get_out else None)
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    tp = {"tp_size": tp_size, "tp_rank": tp_rank}
    new_embed = None
    if type(embed) is nn.Embedding:
        new_embed = VocabParallelEmbedding(embed.num_embeddings, embed.embedding_dim, **tp, **_factory(embed))
        _put(model, names[id(embed)], new_embed, embed)
        plan[names[id(embed)]] = "vocab"
    tied = head is not None and embed is not None and getattr(head, "weight", None) is embed.weight
    if type(head) is nn.Linear and (new_embed is not None or not tied):  # a tie to an embedding kept whole stays
        new_head = ParallelLMHead(head.out_features, head.in_features, bias=head.bias is not None, **tp,
                                  **_factory(head))
        if tied and new_embed is not None:
            new_head.weight = new_embed.weight
            setattr(_parent(model, names[id(head)]), names[id(head)].rpartition(".")[2], new_head)
        else:
            _put(model, names[id(head)], new_head, head)
        if head.bias is not None:
            _retie(model, head.bias, new_head.bias)
        plan[names[id(head)]] = "vocab"


def _retie(model: nn.Module, old: nn.Parameter, new: nn.Parameter) -> None:
    """Point every module still holding `old` (a parameter tied to a replaced layer's: BERT's `cls.predictions.bias`
    is its decoder's bias) at `new`, so the tie survives and the checkpoint's name for it loads the shard."""
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is old:
                module._parameters[key] = new


def _parent(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rpartition(".")[0])


def _put(model: nn.Module, name: str, new: nn.Module, old: nn.Module) -> None:
    _replace(_parent(model, name), name.rpartition(".")[2], new, old)


class LazySlice:
    """A safetensors tensor not read yet. `narrow` composes; any torch op on it (``param.copy_(x)``)
    reads just the narrowed region. `shape` / `dim()` / `size()` need no read."""

    def __init__(self, sliceable, shape: tuple[int, ...], ranges: tuple[tuple[int, int], ...] | None = None):
        self._sliceable = sliceable
        self._ranges = ranges or tuple((0, n) for n in shape)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(n for _, n in self._ranges)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self._ranges)

    def narrow(self, dim: int, start: int, length: int) -> LazySlice:
        dim = dim % self.dim()
        begin, size = self._ranges[dim]
        if start < 0 or length < 0 or start + length > size:
            raise ValueError(f"narrow({dim}, {start}, {length}) is outside a dimension of size {size}")
        ranges = list(self._ranges)
        ranges[dim] = (begin + start, length)
        return LazySlice(self._sliceable, (), tuple(ranges))

    def dtype_name(self) -> str:
        """The file's dtype tag (safetensors' names: "BF16", "F8_E4M3", ...), without a read."""
        return self._sliceable.get_dtype()

    def materialize(self) -> torch.Tensor:
        """Read the region from the file (a real CPU tensor)."""
        return self._sliceable[tuple(slice(b, b + n) for b, n in self._ranges)]

    def __getattr__(self, name: str):  # anything else: read, then behave as the tensor
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        real = tree_map(lambda a: a.materialize() if isinstance(a, LazySlice) else a, (args, kwargs or {}))
        return func(*real[0], **real[1])
