"""Proof that a column-parallel fused layer's outputs reach their row partner head by head (or feature by feature).

Tensor parallelism splits a fused q/k/v projection by heads and a gate/up projection by features, and makes the one
linear their outputs reach (the row partner: o_proj, down_proj) row-parallel (Megatron-LM, Shoeybi et al. 2019).
That is exact only when every operation between them keeps each head's (feature's) values apart: a rank then holds
exactly the partner's inputs of its heads. This module proves it by walking the traced graph from the fused outputs
to the partner with an abstract layout per value, one label per axis:

- ``"HD"``: heads and head dim flattened, head-major (a projection's output); ``"H"`` / ``"D"``: the same split in
  two axes; ``"F"``: a gated MLP's features; ``"x"``: any other axis (batch, sequence).

Every operation on the way must be one whose effect on the labels is known and keeps heads apart: casts and
copies; views / reshapes that split ``HD`` into ``H, D`` or merge them back, with the other axes only regrouped
before them; transposes / permutes; elementwise arithmetic whose other operand is a number or a tensor of size 1 on
the head / feature axes; dropout; RMSNorms over one head (``D``) or over all heads (``HD``, which sharding replaces
with an all-reduced norm); slices and concatenations within a head (partial rotary); transformers' attention function
and torch's scaled_dot_product_attention (heads in, heads out); and, probed on seeded random inputs split by heads as
ranks hold them, function calls (a rotary apply, `head_probes`) and modules without parameters or buffers (a
weightless norm). Anything else, or a value of these paths leaving the module other than the attention weights,
leaves the partner unproven: the fused layer still runs at tensor_parallel_size 1, and sharding refuses the model
with the reason.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fxrewrite import nodes
from fxrewrite.layers.layernorm import RMSNorm, plain_rms_norm_width
from fxrewrite.patterns import head_probes
from fxrewrite.tracer import attention

__all__ = ["row_partner"]

HEADS, DIM, FLAT, FEATURES, OTHER = "H", "D", "HD", "F", "x"
WEIGHTS = "attention weights"
SHAPE = "shape"
"""A value computed from the paths' sizes only (``x.size(-1)``, ``x.shape``): no head's data."""
_SHARDED = (HEADS, FLAT, FEATURES)
_COPIES = frozenset({"to", "float", "half", "bfloat16", "type", "type_as", "contiguous", "clone", "detach"})
_VIEWS = frozenset({"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", torch.reshape, torch.flatten,
                    torch.squeeze, torch.unsqueeze})
_BINARY = frozenset({operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub, torch.mul,
                     torch.div, "add", "sub", "mul", "div", operator.pow, torch.pow, "pow",
                     # elementwise with optional bounds / values: each operand checked as a binary op's
                     torch.clamp, "clamp", "clamp_min", "clamp_max", torch.nan_to_num, "nan_to_num",
                     torch.relu, F.relu, "relu", torch.abs, "abs", torch.square, "square"})
_UNARY = frozenset({operator.neg, torch.neg, "neg", F.dropout, torch.tanh, "tanh", torch.sigmoid, "sigmoid",
                    F.silu, F.gelu, torch.exp, "exp"})
_ELEMENTWISE_MODULES = (nn.Dropout, nn.Identity)


class Unproven(Exception):
    """A node whose effect on the head / feature axes is not known (the message names it)."""


def row_partner(starts: list[fx.Node], root: nn.Module, head_size: int | None = None,
                stopped: str | None = None) -> tuple[str | None, str | None]:
    """(the row partner's child name, None) when `starts` (a fused layer's output values: q / k / v with
    head_size, or a gated product without) reach one plain nn.Linear child and every node between keeps heads
    (features) apart; else (None, why). `stopped`: where the trace stopped, if it did (named when no linear is
    reached: the rest of the forward is not in the graph)."""
    found = nodes.consuming_linears(starts, root)
    if len(found) != 1 or "." in found[0].target:
        names = ", ".join(n.target for n in found) or "none"
        where = f"; the trace stopped before the end of forward ({stopped})" if stopped and not found else ""
        return None, f"the outputs reach {len(found)} linears ({names}), not one child nn.Linear{where}"
    partner = found[0]
    try:
        _prove(starts, partner, root, head_size)
    except Unproven as e:
        return None, f"between the fused outputs and {partner.target}: {e}"
    return partner.target, None


def _prove(starts: list[fx.Node], partner: fx.Node, root: nn.Module, head_size: int | None) -> None:
    first = FLAT if head_size else FEATURES
    layouts: dict[fx.Node, object] = {s: _layout(s, first) for s in starts}
    reached, todo = set(), [u for s in starts for u in s.users]
    while todo:
        n = todo.pop()
        if n not in reached and n is not partner:
            reached.add(n)
            todo.extend(n.users)
    ctx = (root, head_size, layouts, frozenset(starts))
    for n in partner.graph.nodes:  # program order: a node's inputs come first
        if n in reached:
            layouts[n] = _step(n, ctx)
    for n, layout in layouts.items():  # a size read folds to a constant in the graph: the tracer noted it
        for axis in sorted(n.meta.get("size_reads", ())) if isinstance(layout, tuple) else ():
            if axis < len(layout) and layout[axis] in _SHARDED:
                raise Unproven(f"the forward reads the size of {_describe(n)} along its {layout[axis]} axis, of "
                               "which each rank holds a share (a constant in the trace, another number on a rank)")
    if partner.args[:1] != partner.args or layouts.get(partner.args[0]) != _layout(partner.args[0], first):
        raise Unproven(f"{partner.target} reads {_describe(partner.args[0])} with axes "
                       f"{layouts.get(partner.args[0])}, not the fused width last")
    if any(a in layouts for a in partner.kwargs.values()):
        raise Unproven(f"{partner.target} takes a fused output as a keyword")


def _layout(node, last: str) -> tuple:
    val = nodes.meta(node)
    if val is None or val.dim() == 0:
        raise Unproven(f"{_describe(node)} has no traced tensor shape")
    return (OTHER,) * (val.dim() - 1) + (last,)


def _describe(n) -> str:
    if not isinstance(n, fx.Node):
        return repr(n)
    target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
    return f"{n.op} {target}"


def _path_inputs(n: fx.Node, layouts: dict) -> list[fx.Node]:
    """`n`'s inputs that are tensors of the paths (a layout tuple) or tuples of them (a list)."""
    return [a for a in n.all_input_nodes if isinstance(layouts.get(a), (tuple, list))]


def _step(n: fx.Node, ctx) -> object:
    """The layout of `n`'s value from its inputs' (Unproven when the op is not one the module docstring lists)."""
    root, head_size, layouts, starts = ctx
    ins = _path_inputs(n, layouts)
    src = n.args[0] if n.args else None
    weights = [a for a in n.all_input_nodes if layouts.get(a) == WEIGHTS]
    if n.op == "output":
        if ins:
            raise Unproven("a value between them leaves the module (it would hold one rank's heads only)")
        return None
    if weights:  # the attention weights may only be returned (transformers' modules do), not computed with
        return WEIGHTS if not ins and nodes.is_op(n, operator.getitem, *_COPIES) else _no(n)
    if not ins:
        return SHAPE  # sizes / dtypes read off the paths' values: no data of theirs
    if nodes.is_op(n, "dim"):
        return SHAPE
    if n.op == "call_function" and n.target is getattr:
        return _attribute(n, layouts[src]) if src is ins[0] and isinstance(layouts[src], tuple) else _no(n)
    if nodes.is_op(n, operator.getitem) and isinstance(layouts.get(src), list):
        return layouts[src][n.args[1]] if isinstance(n.args[1], int) and n.args[1] < len(layouts[src]) else _no(n)
    if n.op == "call_function" and n.target is attention:
        return _attention(n, layouts)
    if nodes.is_op(n, F.scaled_dot_product_attention):
        return _sdpa(n, layouts)
    if n.op == "call_module":
        return _module(n, root, head_size, layouts)
    if n.op == "call_function" and nodes.is_leaf_call(n):
        return _leaf(n, layouts)
    if any(not isinstance(layouts[a], tuple) for a in ins) or (len(ins) != 1 and not nodes.is_op(n, *_BINARY,
                                                                                                  torch.cat)):
        return _no(n)
    if nodes.is_op(n, *_COPIES, *_UNARY):
        return _single(n, ins, layouts)
    if nodes.is_op(n, *_VIEWS):
        return _view(n, layouts[src], head_size) if src is ins[0] else _no(n)
    if nodes.is_op(n, "transpose", torch.transpose, "permute", torch.permute):
        return _permute(n, layouts[src]) if src is ins[0] else _no(n)
    if nodes.is_op(n, *_BINARY):
        return _binary(n, ins, layouts)
    if nodes.is_op(n, operator.getitem):
        return _slice(n, layouts[src], head_size if src in starts else None) if src is ins[0] else _no(n)
    if nodes.is_op(n, torch.cat):
        return _cat(n, ins, layouts)
    return _no(n)


def _attribute(n: fx.Node, layout: tuple):
    """A tensor-valued attribute (sizes and dtypes fold to constants while tracing): the same values (``.data``,
    ``.real``) or their transpose (``.mT``: the last two axes, ``.T``: all reversed)."""
    name = n.args[1]
    if name in ("data", "real"):
        return layout
    if name == "mT" and len(layout) >= 2:
        return (*layout[:-2], layout[-1], layout[-2])
    if name == "T":
        return tuple(reversed(layout))
    return _no(n)


def _no(n: fx.Node):
    raise Unproven(f"{_describe(n)} is not an operation known to keep heads apart")


def _single(n: fx.Node, ins: list, layouts: dict):
    if ins[0] is not (n.args[0] if n.args else n.kwargs.get("input")):
        return _no(n)  # e.g. x.type_as(fused value): only the first operand may be one
    return layouts[ins[0]]


def _binary(n: fx.Node, ins: list, layouts: dict):
    """Elementwise: operands on the path share one layout; any other operand broadcasts over heads / features."""
    out = nodes.meta(n)
    first = layouts[ins[0]]
    if out is None or any(layouts[a] != first for a in ins) or tuple(out.shape) != tuple(nodes.meta(ins[0]).shape):
        return _no(n)
    for other in (*n.args, *n.kwargs.values()):
        if isinstance(other, fx.Node) and other not in layouts:
            shape = nodes.meta(other)
            if shape is None or shape.dim() > out.dim():
                return _no(n)
            aligned = (1,) * (out.dim() - shape.dim()) + tuple(shape.shape)
            if any(size != 1 and label in _SHARDED for size, label in zip(aligned, first)):
                raise Unproven(f"{_describe(n)} combines it with {_describe(other)}, which varies across heads")
        elif not isinstance(other, (fx.Node, int, float, type(None))):
            return _no(n)
    return first


def _view(n: fx.Node, layout: tuple, head_size: int | None):
    """A reshape keeps the labels when the sharded axes stay the trailing ones (split HD -> H, D, merge back,
    the axes before them regrouped freely)."""
    before, after = nodes.meta(n.args[0]), nodes.meta(n)
    if after is None or not isinstance(layout, tuple):
        return _no(n)
    if tuple(before.shape) == tuple(after.shape):
        return layout
    tail = _feature_tail(layout)
    if tail is None:
        raise Unproven(f"{_describe(n)} reshapes a value whose head axes are not the last ones ({layout})")
    width = 1
    for size in before.shape[len(before.shape) - len(tail):]:
        width *= size
    shape = tuple(after.shape)
    if tail in ((FLAT,), (HEADS, DIM)) and head_size and len(shape) >= 2 and shape[-1] == head_size \
            and shape[-2] * head_size == width:
        return (OTHER,) * (len(shape) - 2) + (HEADS, DIM)
    if tail in ((FLAT,), (HEADS, DIM), (FEATURES,)) and shape and shape[-1] == width:
        return (OTHER,) * (len(shape) - 1) + ((FEATURES,) if tail == (FEATURES,) else (FLAT,))
    raise Unproven(f"{_describe(n)} reshapes {tuple(before.shape)} {layout} to {shape}, not a split or merge of "
                   "whole heads")


def _feature_tail(layout: tuple) -> tuple | None:
    for tail in ((HEADS, DIM), (FLAT,), (FEATURES,)):
        if layout[-len(tail):] == tail and all(a == OTHER for a in layout[:-len(tail)]):
            return tail
    return None


def _permute(n: fx.Node, layout: tuple):
    rank = len(layout)
    dims = [d for d in n.args[1:]] if nodes.is_op(n, "transpose", torch.transpose) else None
    if dims is not None:
        if len(dims) != 2 or not all(isinstance(d, int) for d in dims):
            return _no(n)
        order = list(range(rank))
        a, b = dims[0] % rank, dims[1] % rank
        order[a], order[b] = order[b], order[a]
    else:
        order = list(n.args[1][0] if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else n.args[1:])
        if sorted(d % rank for d in order if isinstance(d, int)) != list(range(rank)):
            return _no(n)
    return tuple(layout[d % rank] for d in order)


def _slice(n: fx.Node, layout: tuple, head_size: int | None):
    """Basic indexing (slices, ints, Ellipsis, None) that slices only within a head (partial rotary), along other
    axes, or a pre-fused projection's output at head boundaries (head_size given only for that: its q | k | v
    slices become the split each rank sizes): the labels of the axes kept."""
    index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    if sum(i is Ellipsis for i in index) > 1 or not all(i is Ellipsis or i is None or type(i) is int
                                                       or _plain_slice(i) for i in index):
        return _no(n)
    named = sum(i is not None and i is not Ellipsis for i in index)
    gap = [slice(None)] * (len(layout) - named)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = (*index[:at], *gap, *index[at + 1:])
    else:
        index = (*index, *gap)
    out, axis = [], 0
    for i in index:
        if i is None:
            out.append(OTHER)
            continue
        label = layout[axis]
        axis += 1
        if type(i) is int:
            if label != OTHER:
                raise Unproven(f"{_describe(n)} picks one entry of a head axis ({label})")
            continue
        full = i.start in (None, 0) and i.stop is None
        bounds = [b for b in (i.start, i.stop) if b is not None]
        if not full and label in _SHARDED and not (label == FLAT and head_size and all(
                type(b) is int and b >= 0 and b % head_size == 0 for b in bounds)):
            raise Unproven(f"{_describe(n)} slices across heads ({i})")
        out.append(label)
    return tuple(out)


def _plain_slice(i) -> bool:
    """A step-1 slice whose bounds are ints or values computed from sizes (``x.shape[-1] // 2``: checked where
    they cut a head axis)."""
    return isinstance(i, slice) and i.step is None and all(b is None or type(b) is int or isinstance(b, fx.Node)
                                                           for b in (i.start, i.stop))


def _cat(n: fx.Node, ins: list, layouts: dict):
    parts = n.args[0] if n.args else n.kwargs.get("tensors")
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or not all(p in layouts for p in parts) or not isinstance(dim, int):
        return _no(n)
    layout = layouts[parts[0]]
    if any(layouts[p] != layout for p in parts) or layout[dim % len(layout)] in _SHARDED:
        raise Unproven(f"{_describe(n)} concatenates along a head axis or values of different layouts")
    return layout


def _module(n: fx.Node, root: nn.Module, head_size: int | None, layouts: dict):
    module = nodes.module_of(n, root)
    ins = _path_inputs(n, layouts)
    if len(ins) != 1 or n.args[:1] != (ins[0],) or len(n.args) != 1 or n.kwargs:
        return _no(n)
    layout = layouts[ins[0]]
    if isinstance(module, _ELEMENTWISE_MODULES):
        return layout
    width = _norm_width(module)
    if width is not None and isinstance(layout, tuple):
        if layout[-1] == DIM and width == head_size:
            return layout  # per head (Qwen3's q_norm / k_norm)
        if layout[-1] == FLAT and _feature_tail(layout) == (FLAT,) and plain_rms_norm_width(module) == width \
                and width == nodes.meta(ins[0]).shape[-1]:
            return layout  # over all heads (OLMoE): sharding makes it all-reduce its sum of squares
    if isinstance(layout, tuple) and HEADS in layout and head_probes.stateless(module) \
            and head_probes.module_splits_by_heads(module, nodes.meta(ins[0]), layout.index(HEADS)):
        return layout  # e.g. NanoChat's weightless q / k RMSNorm
    raise Unproven(f"{_describe(n)} ({type(module).__name__}) is not a norm over one head or over all heads")


def _norm_width(module) -> int | None:
    if isinstance(module, RMSNorm):
        return module.hidden_size
    if type(module) in (nn.LayerNorm, nn.RMSNorm) and len(module.normalized_shape) == 1:
        return module.normalized_shape[0]
    return plain_rms_norm_width(module)


def _attention(n: fx.Node, layouts: dict):
    """transformers' attention function: q / k / v [B, H, S, D] -> (out [B, S, H, D], weights)."""
    want = (OTHER, HEADS, OTHER, DIM)
    args = n.args[1:4]
    if any(a not in layouts or layouts[a] != want for a in args):
        raise Unproven(f"attention reads q / k / v laid out {[layouts.get(a) for a in args]}, not {want}")
    if any(a in layouts for a in (*n.args[4:], *n.kwargs.values())):
        return _no(n)
    return [(OTHER, OTHER, HEADS, DIM), WEIGHTS]


def _sdpa(n: fx.Node, layouts: dict):
    """torch's scaled_dot_product_attention: q / k / v [B, H, S, D] -> out [B, H, S, D], head by head (kv heads in
    groups with enable_gqa); a mask must be the same for every head."""
    want = (OTHER, HEADS, OTHER, DIM)
    names = ("query", "key", "value", "attn_mask")
    args = dict(zip(names, n.args)) | {k: v for k, v in n.kwargs.items() if k in names}
    if any(args.get(k) not in layouts or layouts[args[k]] != want for k in names[:3]):
        raise Unproven(f"scaled_dot_product_attention reads q / k / v laid out "
                       f"{[layouts.get(args.get(k)) for k in names[:3]]}, not {want}")
    mask = args.get("attn_mask")
    if isinstance(mask, fx.Node):
        shape = nodes.meta(mask)
        if mask in layouts or shape is None or shape.dim() > 4 or (shape.dim() >= 3 and shape.shape[-3] != 1):
            raise Unproven("scaled_dot_product_attention takes a mask that is not the same for every head")
    if any(isinstance(v, fx.Node) for k, v in n.kwargs.items() if k not in names) or len(n.args) > 4:
        return _no(n)
    return want


def _leaf(n: fx.Node, layouts: dict):
    """A function call (one node in the trace: a rotary apply, say) whose tensor inputs on the paths share one
    layout with a head axis and whose outputs have their shapes: proven when `head_probes` finds it acting on each
    head alone. The same layouts out as in."""
    ins = [a for a in n.args if isinstance(a, fx.Node) and a in layouts]
    want = layouts[ins[0]] if ins else None
    if not ins or any(layouts[a] != want for a in ins) or not isinstance(want, tuple) or HEADS not in want \
            or any(isinstance(v, fx.Node) and v in layouts for v in n.kwargs.values()):
        raise Unproven(f"{_describe(n)} is a function call whose effect on heads is not known")
    returns = head_probes.call_splits_by_heads(n, ins, want.index(HEADS))
    if returns is None:
        raise Unproven(f"{_describe(n)} does not act on each head alone (random inputs, split by heads)")
    return want if returns is torch.Tensor else [want] * len(ins)
