"""QKV: three linears reading one input (q, k, v) -> one `QKVParallelLinear` matmul, split in three.

Found by dataflow: exactly three plain `nn.Linear` calls read the same value; sizes q >= k == v
(GQA allowed); the head size is the last dim of the ``[..., heads, head_dim]`` view of q
(else the config's head_dim, for q normalised before its view as in OLMo-2).
A single linear already split three ways (Phi-3's ``qkv_proj``): when its three ``[..., a:b]`` slices are proven to
be q | k | v at head boundaries, the slices become one ``split(self.qkv_output_sizes)`` (the same tensors), so that
tensor parallelism can shard it by heads (`fxrewrite.sharding`); otherwise it is reported as present.
"""

from __future__ import annotations

import operator

import libcst as cst
import torch.fx as fx
from torch import nn

from fxrewrite import nodes, source
from fxrewrite.patterns import feature_path
from fxrewrite.patterns import qkv_prefused as prefused
from fxrewrite.layers.input_norm import NORMED_INPUT_ATTR
from fxrewrite.layers.linear import QKVParallelLinear
from fxrewrite.patterns.base import (PREFUSED_ATTR, Context, Match, Pattern, Refusal, copy_requires_grad,
                                     free_attribute, require, require_same_requires_grad, require_unshared)

_ROLES = ("q", "k", "v")
NEW_NAME = "qkv_proj"
SIZES_ATTR = "qkv_output_sizes"  # a pre-fused projection's [q, k, v] widths, per rank once sharded


def linear_groups(traced, size: int, linear=nodes.is_linear) -> list[list[fx.Node]]:
    """Groups of exactly `size` `linear` calls whose only input is the same node (program order)."""
    by_input: dict[fx.Node, list[fx.Node]] = {}
    for n in traced.graph.nodes:
        if linear(n, traced.module) and len(n.args) == 1 and not n.kwargs and isinstance(n.args[0], fx.Node):
            by_input.setdefault(n.args[0], []).append(n)
    return [group for group in by_input.values() if len(group) == size]


def _head_size(q: fx.Node) -> int | None:
    for user in q.users:
        val = nodes.meta(user)
        if nodes.is_op(user, "view", "reshape") and val is not None and val.dim() >= 3:
            return int(val.shape[-1])
    return None


def _config_head_size(config) -> int | None:
    """head_dim from the model config, for q projections normalised before their head view (OLMo-2)."""
    if config is None:
        return None
    head = getattr(config, "head_dim", None)
    heads = getattr(config, "num_attention_heads", None)
    return head or (config.hidden_size // heads if heads and getattr(config, "hidden_size", None) else None)


def _slice_bounds(node: fx.Node) -> tuple[int | None, int | None] | None:
    """(start, stop) of ``x[..., start:stop]`` with constant bounds and no step, else None."""
    index = node.args[1] if nodes.is_op(node, operator.getitem) else None
    if not (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice)):
        return None
    part = index[1]
    ok = part.step is None and all(b is None or type(b) is int for b in (part.start, part.stop))
    return (part.start, part.stop) if ok else None


def _prefused_facts(n: fx.Node, slices: list[fx.Node], traced, ctx: Context) -> tuple | None:
    """Facts proving the slices of linear `n` are q | k | v in program order at head boundaries (k == v <= q,
    together the whole output), or None."""
    lin = traced.module.get_submodule(n.target)
    bounds = [_slice_bounds(u) for u in slices]
    if "." in n.target or None in bounds or not all(0 <= (b or 0) for pair in bounds for b in pair):
        return None
    (q0, a), (a2, b), (b2, end) = bounds
    width = lin.out_features
    if q0 not in (None, 0) or a is None or a != a2 or b is None or b != b2 or end not in (None, width):
        return None
    sizes = (a, b - a, width - b)
    head = _head_size(slices[0]) or _config_head_size(ctx.config)
    if not (head and sizes[1] == sizes[2] and 0 < sizes[1] <= sizes[0] and sizes[0] % head == 0
            and sizes[1] % head == 0):
        return None
    partner, why = feature_path.row_partner([n], traced.module, head, traced.error)
    return (("head_size", head), ("sizes", sizes), ("row_partner", partner), ("row_partner_why", why),
            ("prefused", True))


def _already_fused(traced, ctx: Context) -> list[Match]:
    found = []
    for n in traced.graph.nodes:
        if not nodes.is_linear(n, traced.module):
            continue
        slices = [u for u in n.users if nodes.is_op(u, operator.getitem) and isinstance(u.args[1], tuple)
                  and u.args[1][:1] == (Ellipsis,) and isinstance(u.args[1][-1], slice)]
        if len(slices) == 3 and len(n.users) == 3:  # users keep program order
            facts = _prefused_facts(n, slices, traced, ctx)
            claimed = frozenset({n.name, *(u.name for u in slices)} if facts else {n.name})
            found.append(Match(QKVPattern, claimed, (("qkv", n.target),), facts or (), present=facts is None))
    return found


def _only_reader_input(traced, group: list[fx.Node]) -> tuple[str, int] | None:
    """(name, position) of the forward's parameter when the three projections read it and nothing else does (shapes
    aside, which the trace keeps as constants), in a complete trace; else None. Position: its index among the
    forward's parameters after self. The decoder layer may then hand the attention its un-normalised input and let
    qkv_proj apply the norm (`fxrewrite.patterns.input_norm`)."""
    x = group[0].args[0]
    if traced.partial or x.op != "placeholder" or set(x.users) != set(group) or not isinstance(x.target, str):
        return None
    if x.target.startswith("*"):
        return None
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    return x.target, placeholders.index(x)


class QKVPattern(Pattern):
    """Three plain linears reading one input -> one `QKVParallelLinear` whose output splits into q | k | v
    (vLLM's fused QKV layout). Facts: head_size, row_partner (the linear the attention output reaches), input_param
    (the forward's parameter only the projections read: `_only_reader_input`)."""

    name = "qkv"

    @classmethod
    def match(cls, traced, ctx: Context) -> list[Match]:
        """Each group of three linears on one input; `Refusal`: one is wrapped (LoRA), k != v, mixed bias,
        grandchildren, no head size."""
        matches = _already_fused(traced, ctx)
        for group in linear_groups(traced, 3, nodes.is_linear_like):
            wrapped = [why for why in (nodes.wrapped_linear(n, traced.module) for n in group) if why]
            require(not wrapped, f"{'; '.join(wrapped)}: q/k/v kept unfused")
            mods = [traced.module.get_submodule(n.target) for n in group]
            order = sorted(range(3), key=lambda i: -mods[i].out_features)  # stable: q largest, then k, v
            q, k, v = (group[i] for i in order)
            mq, mk, mv = (mods[i] for i in order)
            require(mk.out_features == mv.out_features,
                    f"{k.target}/{v.target} sizes differ ({mk.out_features} vs {mv.out_features})")
            require(len({m.bias is None for m in mods}) == 1, "q/k/v disagree on bias")
            require(all("." not in n.target for n in group), "q/k/v are not direct children")
            head_size = _head_size(q) or _config_head_size(ctx.config)
            require(head_size is not None, f"no [..., heads, head_dim] view of {q.target} and no head_dim in config")
            require(mq.out_features % head_size == 0 and mk.out_features % head_size == 0,
                    f"head size {head_size} does not divide q/k sizes")
            names = tuple(zip(_ROLES, (q.target, k.target, v.target)))
            partner, why = feature_path.row_partner(group, traced.module, head_size, traced.error)
            facts = (("head_size", head_size), ("row_partner", partner), ("row_partner_why", why),
                     ("input_param", _only_reader_input(traced, group)))
            matches.append(Match(cls, frozenset(n.name for n in group), names, facts))
        return matches

    @classmethod
    def rewrite(cls, match: Match, src, tree: cst.Module) -> cst.Module:
        """``_fx_q, _fx_k, _fx_v = self.qkv_proj(x).split(...)`` before the first call's line; the calls -> those
        names. A pre-fused projection: its three slices -> one split (`qkv_prefused.rewrite`)."""
        if match.fact("prefused"):
            return prefused.rewrite(tree, match.name("qkv"), SIZES_ATTR)
        info = source.collect(tree)
        temps = [f"_fx_{role}" for role in _ROLES]
        require(not info.names & set(temps), "temporaries _fx_q/_fx_k/_fx_v would shadow names in forward")
        calls = [source.unique_self_call(tree, match.name(role), info) for role in _ROLES]
        arg_names = {c.args[0].value.value if len(c.args) == 1 and isinstance(c.args[0].value, cst.Name)
                     and not c.args[0].keyword and not c.args[0].star else None for c in calls}
        require(len(arg_names) == 1 and None not in arg_names, "q/k/v inputs are not one variable")
        (arg,) = arg_names
        block, lines = source.same_block_index(info, calls)
        source.check_not_rebound(block, lines[0], lines[-1], arg)
        stmt = f"{', '.join(temps)} = self.{NEW_NAME}({arg}).split(self.{NEW_NAME}.output_sizes, dim=-1)"
        edits = {id(lines[0]): source.with_statement_before(stmt)}
        edits.update({id(call): cst.Name(temp) for call, temp in zip(calls, temps)})
        tree = source.replace_many(tree, edits)
        return tree

    @classmethod
    def validate(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        """q/k/v are plain linears with one input size, bias, dtype and device, fitting head_size, on this instance
        (pre-fused: one plain linear of the matched width)."""
        if match.fact("prefused"):
            lin = getattr(module, match.name("qkv"), None)
            require(type(lin) is nn.Linear and lin.out_features == sum(match.fact("sizes")),
                    f"{match.name('qkv')} is not an nn.Linear of {sum(match.fact('sizes'))} outputs on this instance")
            free_attribute(module, SIZES_ATTR)
            q, kv, _ = match.fact("sizes")
            bounds = prefused.instance_bounds(module, match.name("qkv"), lin.out_features)
            require(bounds == [(0, q), (q, q + kv), (q + kv, lin.out_features)],
                    f"this instance's slices of {match.name('qkv')} are {bounds}, not the traced {[q, kv, kv]}")
            return
        mods = [getattr(module, match.name(r), None) for r in _ROLES]
        require(all(type(m) is nn.Linear for m in mods), "q/k/v are not all nn.Linear on this instance")
        free_attribute(module, NEW_NAME)
        head = match.fact("head_size")
        q, k, v = mods
        require(k.out_features == v.out_features and q.out_features % head == 0 and k.out_features % head == 0,
                "q/k/v sizes on this instance do not fit the head size")
        require(len({m.in_features for m in mods}) == 1 and len({m.bias is None for m in mods}) == 1,
                "q/k/v input sizes or biases differ on this instance")
        require(len({(m.weight.dtype, m.weight.device) for m in mods}) == 1, "q/k/v dtypes or devices differ")
        require_same_requires_grad({match.name(r): m for r, m in zip(_ROLES, mods)})
        require_unshared(ctx, module, {match.name(r): m for r, m in zip(_ROLES, mods)})

    @classmethod
    def build(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        """Set ``qkv_proj`` [(Hq + 2*Hkv) * D, H] (old dtype/device) filled from q, k, v; delete them. A pre-fused
        projection stays as it is: its split sizes go in ``qkv_output_sizes`` and its facts in `PREFUSED_ATTR` (head
        size, heads, kv heads, row partner), which `fxrewrite.sharding` reads to shard it by heads."""
        if match.fact("prefused"):
            q, kv, _ = match.fact("sizes")
            head = match.fact("head_size")
            setattr(module, SIZES_ATTR, [q, kv, kv])
            facts = {"head_size": head, "num_heads": q // head, "num_kv_heads": kv // head,
                     "row_partner": match.fact("row_partner"), "row_partner_why": match.fact("row_partner_why"),
                     "sizes_attr": SIZES_ATTR}
            module.__dict__.setdefault(PREFUSED_ATTR, []).append(("qkv", match.name("qkv"), facts))
            return
        q, k, v = (getattr(module, match.name(r)) for r in _ROLES)
        head = match.fact("head_size")
        fused = QKVParallelLinear(q.in_features, head, q.out_features // head, k.out_features // head,
                                  bias=q.bias is not None, params_dtype=q.weight.dtype, device=q.weight.device)
        for role, lin in zip(_ROLES, (q, k, v)):
            fused.weight.weight_loader(fused.weight, lin.weight.detach(), role)
            if lin.bias is not None:
                fused.bias.weight_loader(fused.bias, lin.bias.detach(), role)
        copy_requires_grad(fused, q, k, v)
        fused.row_partner, fused.row_partner_why = match.fact("row_partner"), match.fact("row_partner_why")
        for role in _ROLES:
            delattr(module, match.name(role))
        setattr(module, NEW_NAME, fused)
        if match.fact("input_param"):  # the layer's input norm may run inside qkv_proj
            name, position = match.fact("input_param")
            module.__dict__[NORMED_INPUT_ATTR] = (name, NEW_NAME, position)

    @classmethod
    def describe(cls, match: Match) -> str:
        """``q_proj,k_proj,v_proj -> qkv_proj`` (or ``(already fused)``)."""
        if match.present:
            return f"{match.name('qkv')} (already fused)"
        if match.fact("prefused"):
            return f"{match.name('qkv')} (already fused; q/k/v slices -> one split)"
        return f"{','.join(match.name(r) for r in _ROLES)} -> {NEW_NAME}"

    @classmethod
    def shards(cls, match: Match):
        """q, k, v -> shards "q", "k", "v" of ``qkv_proj``."""
        if match.present or match.fact("prefused"):
            return []
        return [(NEW_NAME, [(match.name(r), r) for r in _ROLES])]


__all__ = ["QKVPattern", "Refusal"]
