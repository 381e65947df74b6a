"""Predicates and finders over traced fx graphs (pattern-agnostic helpers for `patterns/`).

A node's module is looked up on the traced instance (`Traced.module`); meta values are in
``node.meta["val"]`` (see `fxrewrite.tracer`).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import nn

# Methods/functions that change neither values nor dataflow meaning for matching purposes.
_CASTS = frozenset({"to", "float", "type_as", "contiguous", "type"})


def module_of(node: fx.Node, root: nn.Module) -> nn.Module | None:
    """The child module a `call_module` node calls, else None."""
    if node.op != "call_module":
        return None
    try:
        return root.get_submodule(node.target)
    except AttributeError:
        return None


def is_linear(node: fx.Node, root: nn.Module) -> bool:
    """A call of a plain `nn.Linear` child (exact type: subclasses may compute something else)."""
    return type(module_of(node, root)) is nn.Linear


def wrapped_linear(node: fx.Node, root: nn.Module) -> str | None:
    """Why a call of a linear-like child is not a plain `nn.Linear` (a LoRA adapter around one, a subclass,
    another wrapper with a ``base_layer``), e.g. "q_proj is LoRA-wrapped (peft Linear)"; None for a plain
    `nn.Linear` and for anything that is no linear at all. Patterns refuse such near misses with this reason."""
    module = module_of(node, root)
    if module is None or type(module) is nn.Linear:
        return None
    kind = f"{type(module).__module__.split('.')[0]} {type(module).__name__}"
    base = getattr(module, "base_layer", None)
    if isinstance(base, nn.Linear):
        wrapper = "LoRA-wrapped" if hasattr(module, "lora_A") else "wrapped"
        return f"{node.target} is {wrapper} ({kind} around nn.Linear)"
    if isinstance(module, nn.Linear):
        return f"{node.target} is a {kind} (an nn.Linear subclass, which may compute something else)"
    return None


def is_linear_like(node: fx.Node, root: nn.Module) -> bool:
    """A plain `nn.Linear` call, or one `wrapped_linear` can explain (for near-miss reports)."""
    return is_linear(node, root) or wrapped_linear(node, root) is not None


def is_op(node: fx.Node, *targets) -> bool:
    """Whether `node` calls one of `targets`: functions/operators, or method names as strings."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in targets
    if node.op == "call_method":
        return node.target in targets
    return False


def is_leaf_call(node: fx.Node) -> bool:
    """A call of a child module or of a leaf function (not a tensor op)."""
    return node.op == "call_module" or (node.op == "call_function" and getattr(node.target, "__module__", "")
                                        not in ("_operator", "torch", "torch._C._nn", "torch.nn.functional"))


def peel(node, ops: frozenset = _CASTS):
    """Strip casts (`.to`, `.float`, `.type_as`, `.contiguous`) off `node`; returns the source node."""
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in ops:
        node = node.args[0]
    return node


def placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def output_value(graph: fx.Graph):
    """The argument of the output node (a node, tuple, dict...), or None for a partial graph."""
    outs = [n for n in graph.nodes if n.op == "output"]
    return outs[0].args[0] if outs else None


def getitem_users(node: fx.Node) -> dict[int, fx.Node]:
    """{index: node} for `operator.getitem(node, index)` users with an int index."""
    return {u.args[1]: u for u in node.users if is_op(u, operator.getitem) and isinstance(u.args[1], int)}


def meta(node) -> torch.Tensor | None:
    """The meta tensor of `node`, or None when unknown / not a tensor."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def consuming_linears(starts: list[fx.Node], root: nn.Module) -> list[fx.Node]:
    """The plain `nn.Linear` calls that the values `starts` reach first, walking forward through every
    other node (views, norms, the attention call, ...), in program order: the projection reading what
    a fused layer's outputs become (o_proj after q/k/v, down_proj after act(gate) * up)."""
    found, seen, todo = set(), set(), [u for s in starts for u in s.users]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if is_linear(n, root):
            found.add(n)
        else:
            todo.extend(n.users)
    return [n for n in starts[0].graph.nodes if n in found]

