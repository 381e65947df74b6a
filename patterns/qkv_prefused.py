"""The source side of a pre-fused QKV projection (Phi-3's ``qkv_proj``, part of the `qkv` pattern): its three
``v[..., a:b]`` slices found in ``forward``, rewritten into one split, and their bounds evaluated for one instance.

The traced graph shows the bounds of one call only. A bound is accepted when the source builds it from int literals,
``self.<attr>...`` chains (the config included), ``+ - * //`` and locals assigned once from such (Phi-3's
``query_pos = self.config.num_attention_heads * self.head_dim``): then it is the same on every call of that
instance, and `instance_bounds` computes it from the instance. A bound read from a call argument, a subscript or a
call is refused, as is an instance whose bounds differ from the traced ones (layers grouped in one trace).
"""

from __future__ import annotations

import operator

import libcst as cst
from torch import nn

from fxrewrite import source

_ROLES = ("q", "k", "v")
_OPS = {cst.Add: operator.add, cst.Subtract: operator.sub, cst.Multiply: operator.mul,
        cst.FloorDivide: operator.floordiv}
_FORM_ONLY = object()  # `_value`'s module for a check of the expression's form (attributes read as 1)


def rewrite(tree: cst.Module, attr: str, sizes_attr: str) -> cst.Module:
    """``v = self.<attr>(x)`` then ``v[..., :a]``, ``v[..., a:b]``, ``v[..., b:]`` in three later statements of the
    same block -> ``_fx_q, _fx_k, _fx_v = v.split(self.<sizes_attr>, dim=-1)`` before the first, each slice -> its
    temporary. SourceError when the source does not show exactly that, or a bound is not built from the instance."""
    info = source.collect(tree)
    temps = [f"_fx_{role}" for role in _ROLES]
    if info.names & {*temps, sizes_attr}:
        raise source.SourceError(f"{', '.join(temps)} / {sizes_attr} would shadow names in forward")
    var, subs, lines = _slices(tree, attr, info)
    defs = _local_defs(tree)
    fn = source.function_def(tree)
    if not _first_is_self(fn):
        raise source.SourceError("forward's first parameter is not self")
    for sub in subs:
        for bound in _bounds(sub):
            if bound is not None and _value(bound, _FORM_ONLY, defs) is None:
                raise source.SourceError(f"a slice bound of {var!r} ({tree.code_for_node(bound)}) is not built from "
                                         "int literals, self.<attr> and locals assigned once from them")
    stmt = f"{', '.join(temps)} = {var}.split(self.{sizes_attr}, dim=-1)"
    edits = {id(lines[1]): source.with_statement_before(stmt)}
    edits.update({id(sub): cst.Name(temp) for sub, temp in zip(subs, temps)})
    return source.replace_many(tree, edits)


def instance_bounds(module: nn.Module, attr: str, width: int) -> list[tuple[int | None, int | None]] | None:
    """The (start, stop) of each of the three slices as ``module``'s forward computes them (an open start is 0, an
    open stop `width`; None for a bound not of the accepted form), or None when the source does not show the
    three slices."""
    try:
        tree = source.ForwardSource.recover(type(module)).tree
        _, subs, _ = _slices(tree, attr, source.collect(tree))
    except source.SourceError:
        return None
    defs = _local_defs(tree) if _first_is_self(source.function_def(tree)) else {}
    out = []
    for sub in subs:
        start, stop = _bounds(sub)
        out.append((0 if start is None else _value(start, module, defs),
                    width if stop is None else _value(stop, module, defs)))
    return out


def _first_is_self(fn: cst.FunctionDef) -> bool:
    first = fn.params.posonly_params[:1] or fn.params.params[:1]
    return bool(first) and first[0].name.value == "self"


def _slices(tree: cst.Module, attr: str, info) -> tuple[str, list[cst.Subscript], list]:
    """(variable, its three slices in program order, [assignment statement, the slices' three statements])."""
    call = source.unique_self_call(tree, attr, info)
    assign = source.parent(info, call)
    if not (isinstance(assign, cst.Assign) and len(assign.targets) == 1
            and isinstance(assign.targets[0].target, cst.Name)):
        raise source.SourceError(f"self.{attr}(...) is not assigned to one name")
    var = assign.targets[0].target.value
    subs = [node for node in _walk(tree) if isinstance(node, cst.Subscript) and isinstance(node.value, cst.Name)
            and node.value.value == var]
    uses = [node for node in _walk(tree) if isinstance(node, cst.Name) and node.value == var]
    if len(subs) != 3 or len(uses) != 4 or not all(_is_ellipsis_slice(sub) for sub in subs):
        raise source.SourceError(f"{var!r} is not used as exactly three [..., a:b] slices")
    block, lines = source.same_block_index(info, [*subs, call])
    if len(lines) != 4 or lines[0] is not source.enclosing_statement(info, call)[0]:
        raise source.SourceError(f"the three slices of {var!r} are not three statements after its assignment")
    body = source.block_statements(block)
    after = body[next(i for i, stmt in enumerate(body) if stmt is lines[0]) + 1]
    source.check_not_rebound(block, after, lines[-1], var)  # (the slices' own statements: `uses` counts them)
    order = {id(stmt): i for i, stmt in enumerate(lines[1:])}
    subs.sort(key=lambda sub: order[id(source.enclosing_statement(info, sub)[0])])
    return var, subs, lines


def _bounds(sub: cst.Subscript) -> tuple:
    part = sub.slice[1].slice
    return part.lower, part.upper


def _local_defs(tree: cst.Module) -> dict[str, cst.BaseExpression]:
    """{name: value} for locals bound exactly once in forward, by a plain ``name = value`` of its body (not a
    parameter; bound by no other statement, nested ones included). Empty when forward's first parameter is not
    ``self`` (its attributes are what the bounds may read)."""
    fn = source.function_def(tree)
    params = {p.name.value for p in (*fn.params.posonly_params, *fn.params.params, *fn.params.kwonly_params)}
    if not _first_is_self(fn):
        return {}
    body = source.block_statements(fn.body)
    defs = {}
    for stmt in body:
        small = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 else None
        if not (isinstance(small, cst.Assign) and len(small.targets) == 1
                and isinstance(small.targets[0].target, cst.Name)):
            continue
        name = small.targets[0].target.value
        if name not in params and not any(name in source.assigned_names(other) for other in body if other is not stmt):
            defs[name] = small.value
    return defs


def _value(expr: cst.BaseExpression, module, defs: dict, depth: int = 0) -> int | None:
    """The int `expr` computes from `module` (``self``), or None when it is not of the accepted form."""
    if isinstance(expr, cst.Integer):
        return int(expr.evaluated_value)
    if isinstance(expr, cst.BinaryOperation) and type(expr.operator) in _OPS:
        left, right = _value(expr.left, module, defs, depth), _value(expr.right, module, defs, depth)
        if left is None or right is None or (isinstance(expr.operator, cst.FloorDivide) and right == 0):
            return None
        return _OPS[type(expr.operator)](left, right)
    if isinstance(expr, cst.Name) and expr.value in defs and depth < 8:
        return _value(defs[expr.value], module, defs, depth + 1)
    chain = []
    while isinstance(expr, cst.Attribute):
        chain.append(expr.attr.value)
        expr = expr.value
    if not chain or not (isinstance(expr, cst.Name) and expr.value == "self"):
        return None
    if module is _FORM_ONLY:
        return 1
    value = module
    for name in reversed(chain):
        value = getattr(value, name, None)
    return value if type(value) is int else None


def _walk(tree: cst.CSTNode):
    """Every node of `tree`, parents first."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.children))


def _is_ellipsis_slice(sub: cst.Subscript) -> bool:
    """``v[..., a:b]`` (no step)."""
    items = sub.slice
    return (len(items) == 2 and isinstance(items[0].slice, cst.Index) and isinstance(items[0].slice.value, cst.Ellipsis)
            and isinstance(items[1].slice, cst.Slice) and items[1].slice.step is None)
