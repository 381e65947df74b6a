"""Predicates and finders over traced fx graphs (pattern-agnostic helpers for `patterns/`).

A node's module is looked up on the traced instance (`Traced.module`); meta values are in
``node.meta["val"]`` (see `fxrewrite.tracer`).
"""

from __future__ import annotations

import operator
from typing import Callable, Iterable

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


def find_node(graph: fx.Graph, pred: Callable[[fx.Node], bool]) -> list[fx.Node]:
    """All nodes of `graph` for which `pred` holds, in program order."""
    return [n for n in graph.nodes if pred(n)]


def placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def output_value(graph: fx.Graph):
    """The argument of the output node (a node, tuple, dict...), or None for a partial graph."""
    outs = [n for n in graph.nodes if n.op == "output"]
    return outs[0].args[0] if outs else None


def getitem_users(node: fx.Node) -> dict[int, fx.Node]:
    """{index: node} for `operator.getitem(node, index)` users with an int index."""
    return {u.args[1]: u for u in node.users if is_op(u, operator.getitem) and isinstance(u.args[1], int)}


def upstream_linear(node, root: nn.Module, through: frozenset = frozenset({"view", "reshape", "transpose"})):
    """Walk back through casts and view-like methods to an `nn.Linear` call, or None."""
    node = peel(node)
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in through | _CASTS:
        node = node.args[0]
    return node if isinstance(node, fx.Node) and is_linear(node, root) else None


def meta(node) -> torch.Tensor | None:
    """The meta tensor of `node`, or None when unknown / not a tensor."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def all_inputs(nodes: Iterable[fx.Node]) -> set[fx.Node]:
    """Every node any of `nodes` reads."""
    return {a for n in nodes for a in n.all_input_nodes}
