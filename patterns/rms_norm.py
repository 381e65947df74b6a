"""RMSNorm: x * rsqrt(mean(x², -1) + eps) * weight (or * (1 + weight)) -> `RMSNorm`; then, in the
parent, ``x = r + h; r = x; x = norm(x)`` -> ``x, r = norm(h, r)`` (fused residual add), or, when the normed x
goes only to a `FusedMoE` child in the next statement (``x = self.mlp(x)``), ``x, r = self.mlp(h, norm=self.norm,
residual=r)``: the block folds the add and the norm into its router launch at decode (vLLM's fused add-norm
handed to the consumer, as the native models do); a closing ``x = r + x`` on the block's output goes in too
(``add_residual=True``: the experts' down kernel adds r at decode, so no separate add launch, which would also end
the chain of programmatic-dependent launches between the layers' kernels). A dense gated MLP whose whole forward the
gated-MLP rewrite proved (`fxrewrite.layers.gated_mlp.GATED_MLP_ATTR`), read the same way and closed by ``x = r + x``,
folds the same five statements into ``x, r = self.norm.forward_mlp(h, r, self.mlp)``: at decode the norm runs in
gate_up_proj's GEMV and the closing add in down_proj's epilogue.

`RMSNormPattern` matches a module whose whole forward is that dataflow (float32 upcast
optional, Gemma's ``(1 + weight)`` form as ``offset``) and replaces the module. eps is read per
instance from the one float attribute holding the traced constant. `ResidualRMSNormPattern`
matches, in a parent's graph, an add whose result feeds a fused `RMSNorm` child and a later
add, and rewrites the three source statements (four or five with the MoE fold, five with the MLP fold) into one
fused call.
"""

from __future__ import annotations

import operator

import libcst as cst
import torch
from torch import nn

from fxrewrite import nodes, source
from fxrewrite.layers.fused_moe import FusedMoE
from fxrewrite.layers.fold_guard import runs_bound_forward
from fxrewrite.layers.gated_mlp import GATED_MLP_ATTR
from fxrewrite.layers.layernorm import RMSNorm, note_residual_call
from fxrewrite.patterns.base import Context, Match, Pattern, Refusal, require, require_unshared


def _split(node, pred):
    """(a, b) args of a binary node where pred(a) holds (either order), else None."""
    if len(node.args) != 2:
        return None
    a, b = node.args
    if pred(a):
        return a, b
    if pred(b):
        return b, a
    return None


def _weight_term(node) -> tuple[str, float] | None:
    """(parameter name, offset) for `w`, `w.float()` or `c + w`."""
    node = nodes.peel(node)
    if getattr(node, "op", None) == "get_attr":
        return node.target, 0.0
    if getattr(node, "op", None) == "call_function" and nodes.is_op(node, operator.add):
        pair = _split(node, lambda a: isinstance(a, (int, float)))
        if pair and getattr(nodes.peel(pair[1]), "op", None) == "get_attr":
            return nodes.peel(pair[1]).target, float(pair[0])
    return None


def _normed(node, x):
    """eps when `node` is x * rsqrt(mean(x**2, -1, keepdim=True) + eps), x the same node, else None."""
    if not nodes.is_op(node, operator.mul, torch.mul):
        return None
    pair = _split(node, lambda a: nodes.is_op(a, torch.rsqrt, "rsqrt"))
    if pair is None or pair[1] is not x:
        return None
    add = pair[0].args[0]
    eps_pair = _split(add, lambda a: isinstance(a, float)) if nodes.is_op(add, operator.add) else None
    if eps_pair is None:
        return None
    eps, mean = eps_pair
    dims = mean.args[1:] or (mean.kwargs.get("dim"),)
    if not (nodes.is_op(mean, "mean") and dims[0] in (-1, (-1,), [-1]) and mean.kwargs.get("keepdim")):
        return None
    sq = mean.args[0]
    is_square = (nodes.is_op(sq, "pow", torch.pow, operator.pow) and sq.args[0] is x and sq.args[1] == 2) or (
        nodes.is_op(sq, operator.mul) and sq.args == (x, x))
    return eps if is_square else None


def _lossy_cast(graph, x) -> str | None:
    """'<node> casts to <dtype>' for the first cast in `graph` to a dtype other than float32 and x's own (x: the
    forward's input), e.g. ``.to(torch.float16)`` in a float32 model: a rounding the fused norm does not do (the
    matcher reads through casts); None when there is none."""
    allowed = {torch.float32, getattr(nodes.meta(x), "dtype", None)}
    for node in graph.nodes:
        val = nodes.meta(node)
        if nodes.peel(node) is not node and val is not None and val.dtype not in allowed:
            return f"{node.name} casts to {val.dtype}"
    return None


def _eps_attribute(module: nn.Module, eps: float) -> str:
    names = [k for k, v in vars(module).items() if isinstance(v, float) and v == eps]
    require(len(names) == 1, f"eps {eps} is held by {len(names)} float attributes, expected exactly one")
    return names[0]


class RMSNormPattern(Pattern):
    """A module computing ``x * rsqrt(mean(x², -1) + eps) * w`` (Zhang & Sennrich 2019; Gemma's ``(1 + w)``
    as offset; float32 upcast optional) -> `fxrewrite.layers.layernorm.RMSNorm`. Facts: offset, upcast."""

    name = "rms_norm"
    scope = "module"

    @classmethod
    def match(cls, traced, ctx: Context) -> list[Match]:
        """The whole forward as that dataflow on its one input, else []; `Refusal` unless one float attribute is eps
        and every cast is to float32 or to the input's dtype."""
        out = nodes.output_value(traced.graph)
        if not hasattr(out, "op") or not nodes.is_op(nodes.peel(out), operator.mul, torch.mul):
            return []
        inputs = [p for p in nodes.placeholders(traced.graph) if p.users]
        if len(inputs) != 1:
            return []
        for w, h in (nodes.peel(out).args, nodes.peel(out).args[::-1]):
            weight, h = _weight_term(w), nodes.peel(h)
            x = h.args[0] if hasattr(h, "args") and h.args and hasattr(h.args[0], "op") else None
            eps = _normed(h, x) if weight and x is not None else None
            if eps is not None and nodes.peel(x) is inputs[0]:
                lossy = _lossy_cast(traced.graph, inputs[0])
                require(lossy is None, f"{lossy}, a rounding the fused RMSNorm would not do")
                upcast = x is not inputs[0]
                eps_name = _eps_attribute(traced.module, eps)
                claimed = frozenset(n.name for n in traced.graph.nodes if n.op != "output")
                facts = (("offset", weight[1]), ("upcast", upcast))
                return [Match(cls, claimed, (("weight", weight[0]), ("eps", eps_name)), facts)]
        return []

    @classmethod
    def validate(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        """weight is a 1-D parameter and eps a float on this instance."""
        weight = getattr(module, match.name("weight"), None)
        require(isinstance(weight, nn.Parameter) and weight.dim() == 1, "weight is not a 1-D parameter")
        require(isinstance(getattr(module, match.name("eps"), None), float), "eps attribute is not a float")
        require_unshared(ctx, None, {"": module})  # its weight also another norm's: the copy would untie them

    @classmethod
    def build(cls, match: Match, module: nn.Module, ctx: Context) -> nn.Module:
        """The replacement `RMSNorm` [hidden]: this instance's weight (dtype, device, requires_grad), eps, mode."""
        weight = getattr(module, match.name("weight"))
        norm = RMSNorm(weight.shape[0], getattr(module, match.name("eps")), offset=match.fact("offset"),
                       upcast=match.fact("upcast"), dtype=weight.dtype, device=weight.device)
        norm.weight.weight_loader(norm.weight, weight.detach())
        norm.weight.requires_grad_(weight.requires_grad)
        norm.train(module.training)
        return norm

    @classmethod
    def describe(cls, match: Match) -> str:
        """``RMSNorm`` (with its offset when nonzero)."""
        offset = match.fact("offset")
        return "RMSNorm" + (f" (offset {offset:g})" if offset else "")


class ResidualRMSNormPattern(Pattern):
    """In a parent, ``x = r + e; r = x; x = self.norm(x)`` with a fused `RMSNorm` norm ->
    ``x, r = self.norm(e, r)`` (vLLM's fused residual add); followed by ``x = self.moe(x)`` with a `FusedMoE`
    child that alone reads x -> ``x, r = self.moe(e, norm=self.norm, residual=r)``; and when ``x = r + x`` closes
    the block (the moe output's only reader) -> ``x, r = self.moe(e, norm=self.norm, residual=r, add_residual=True)``,
    whose x is already ``r + moe(...)``. With a proven gated MLP child instead of the `FusedMoE` (closing add
    required) -> ``x, r = self.norm.forward_mlp(e, r, self.mlp)``.

    Facts: add_residual (the closing add is folded), consumer_kind ("moe" / "mlp")."""

    name = "residual_rms_norm"

    @classmethod
    def match(cls, traced, ctx: Context) -> list[Match]:
        """Each add whose result feeds a direct `RMSNorm` child and a later add."""
        matches = []
        for add in traced.graph.nodes:
            if not nodes.is_op(add, operator.add) or len(add.users) != 2:
                continue
            norm = next((u for u in add.users if u.op == "call_module" and u.args == (add,) and not u.kwargs), None)
            other = next((u for u in add.users if u is not norm), None)
            if norm is None or not nodes.is_op(other, operator.add) or "." in norm.target:
                continue
            if isinstance(traced.module.get_submodule(norm.target), RMSNorm):
                names, claimed = [("norm", norm.target)], {add.name, norm.name}
                consumer, kind, facts = *_consumer(traced, norm), ()
                closes = consumer is not None and _closes_with(other, add, consumer)
                if kind == "mlp" and not closes:  # the MLP fold always takes the closing add
                    consumer = None
                if consumer is not None:  # in names: hooks on it refuse the match (compiler._check_instance)
                    names.append(("consumer", consumer.target))
                    claimed.add(consumer.name)
                    facts = (("consumer_kind", kind),)
                    if closes:  # ``x = r + self.moe(...)``: the add rides along too
                        claimed.add(other.name)
                        facts += (("add_residual", True),)
                matches.append(Match(cls, frozenset(claimed), tuple(names), facts))
        return matches

    @classmethod
    def rewrite(cls, match: Match, src, tree: cst.Module) -> cst.Module:
        """The three statements -> one fused call (line numbers, end-of-line comment kept); `Refusal` otherwise."""
        info = source.collect(tree)
        call = source.unique_self_call(tree, match.name("norm"), info)
        line, block = source.enclosing_statement(info, call)
        body = source.block_statements(block)
        i = next(k for k, s in enumerate(body) if s is line)
        require(i >= 2, "norm call is not preceded by the residual add and copy")
        x, r, e = _residual_shape(body[i - 2], body[i - 1], line, call)
        merged = [body[i - 2], body[i - 1], line]
        consumer = dict(match.names).get("consumer")
        if consumer is None:
            new = cst.parse_statement(f"{x}, {r} = self.{match.name('norm')}(__E__, {r})\n")
        else:
            require(i + 1 < len(body) and _is_self_call(body[i + 1], x, consumer),
                    f"the statement after the norm is not `{x} = self.{consumer}({x})`")
            merged.append(body[i + 1])
            closing = ""
            if match.fact("add_residual"):
                require(i + 2 < len(body) and _is_residual_add(body[i + 2], x, r),
                        f"the statement after the {consumer} call is not `{x} = {r} + {x}`")
                merged.append(body[i + 2])
                closing = ", add_residual=True"
            norm_name = match.name("norm")
            call = f"self.{consumer}(__E__, norm=self.{norm_name}, residual={r}{closing})"
            if match.fact("consumer_kind") == "mlp":
                call = f"self.{norm_name}.forward_mlp(__E__, {r}, self.{consumer})"
            new = cst.parse_statement(f"{x}, {r} = {call}\n")
        new = new.deep_replace(new.body[0].value.args[0].value, e)
        total = sum(source.line_count(tree, s) for s in merged)
        leading = [ln for s in merged for ln in s.leading_lines]
        used = cst.Module(body=[new.with_changes(leading_lines=leading)]).code.count("\n")
        moved = (f"the residual add and `{r} = {x}` are in the norm call" if consumer is None
                 else f"the residual add, `{r} = {x}`, the norm{' and the closing add' if closing else ''} are in the "
                      f"{consumer} call")
        pad = [cst.EmptyLine(comment=cst.Comment(f"# fxrewrite: {moved} below"))]
        pad += [cst.EmptyLine(indent=False)] * (total - used - 1)  # the same line count: tracebacks keep their lines
        new = new.with_changes(leading_lines=(pad if total > used else []) + leading)
        comments = [s.trailing_whitespace for s in reversed(merged) if s.trailing_whitespace.comment]
        if comments:  # keep an end-of-line comment of the merged statements
            new = new.with_changes(trailing_whitespace=comments[0])
        new_body = body[: i - 2] + [new] + body[i - 2 + len(merged):]
        return tree.deep_replace(block, block.with_changes(body=new_body))

    @classmethod
    def validate(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        """The norm child is a fused `RMSNorm` on this instance (and the consumer, if any, a `FusedMoE`, or a gated MLP
        proven whole with the forward fxrewrite bound)."""
        require(isinstance(getattr(module, match.name("norm"), None), RMSNorm), "norm child is not a fused RMSNorm")
        consumer = dict(match.names).get("consumer")
        if match.fact("consumer_kind") == "mlp":
            require(_gated_mlp(getattr(module, consumer, None)),
                    f"{consumer} child is not a gated MLP whose whole forward was rewritten")
        else:
            require(consumer is None or isinstance(getattr(module, consumer, None), FusedMoE),
                    f"{consumer} child is not a FusedMoE")

    @classmethod
    def build(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        """Nothing to build: the fused `RMSNorm` takes the residual already; only the source changes. With the MLP fold,
        the MLP's gate_up_proj is marked as called through `norm_forward` (the load-time GEMV tuner times that kind).
        The norm notes its new call form (`note_residual_call`: a forward hook registered on it later sees
        transformers' call, `fxrewrite.layers.residual_hooks`; others are warned)."""
        kind = match.fact("consumer_kind")
        inside = {"mlp": "; without hooks, inside the MLP's gate_up_proj", "moe": "; without hooks, inside the MoE "
                  "router's launch"}.get(kind, "")
        note_residual_call(getattr(module, match.name("norm")), "called as norm(x, residual), returning (normed, "
                           "x + residual): the decoder layer's residual add folded in (transformers: norm(x + "
                           f"residual)){inside}")
        if kind == "mlp":
            mlp = getattr(module, dict(match.names)["consumer"])
            gate_up = getattr(mlp, mlp.__dict__[GATED_MLP_ATTR][0])
            gate_up.gemv_prologue = "norm"
        return None

    @classmethod
    def describe(cls, match: Match) -> str:
        """``residual add + <norm>`` (``-> <consumer> router`` with the MoE fold, ``+ residual add`` with its closing
        add)."""
        consumer = dict(match.names).get("consumer")
        closing = " + residual add" if match.fact("add_residual") else ""
        part = "gate_up" if match.fact("consumer_kind") == "mlp" else "router"
        return f"residual add + {match.name('norm')}" + (f" -> {consumer} {part}{closing}" if consumer else "")


def _consumer(traced, norm):
    """(node, "moe") for a direct `FusedMoE` child that is the norm's only reader, with the normed x as its one
    argument; (node, "mlp") for such a child that is a proven gated MLP (`_gated_mlp`); else (None, None)."""
    users = list(norm.users)
    if len(users) != 1:
        return None, None
    user = users[0]
    if user.op != "call_module" or user.args != (norm,) or user.kwargs or "." in user.target:
        return None, None
    child = traced.module.get_submodule(user.target)
    if isinstance(child, FusedMoE):
        return user, "moe"
    return (user, "mlp") if _gated_mlp(child) else (None, None)


def _gated_mlp(child) -> bool:
    """`child` is a module the gated-MLP rewrite proved whole (`GATED_MLP_ATTR`) and still runs the forward fxrewrite
    bound to it."""
    return isinstance(child, nn.Module) and GATED_MLP_ATTR in child.__dict__ and runs_bound_forward(child)


def _closes_with(later, add, consumer) -> bool:
    """`later` is ``add + consumer`` (either order) and the consumer's output has no other reader."""
    return (nodes.is_op(later, operator.add) and len(later.args) == 2 and not later.kwargs
            and set(later.args) == {add, consumer} and add is not consumer and list(consumer.users) == [later])


def _is_residual_add(stmt, x: str, r: str) -> bool:
    """`stmt` is ``x = r + x`` or ``x = x + r``."""
    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign)):
        return False
    a = stmt.body[0]
    value = a.value
    names = {getattr(value, side).value for side in ("left", "right")
             if isinstance(value, cst.BinaryOperation) and isinstance(getattr(value, side), cst.Name)}
    return (len(a.targets) == 1 and isinstance(a.targets[0].target, cst.Name) and a.targets[0].target.value == x
            and isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Add) and names == {x, r})


def _is_self_call(stmt, x: str, child: str) -> bool:
    """`stmt` is ``x = self.<child>(x)``."""
    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign)):
        return False
    a = stmt.body[0]
    call = a.value
    return (len(a.targets) == 1 and isinstance(a.targets[0].target, cst.Name) and a.targets[0].target.value == x
            and isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute)
            and isinstance(call.func.value, cst.Name) and call.func.value.value == "self"
            and call.func.attr.value == child and len(call.args) == 1 and call.args[0].keyword is None
            and call.args[0].star == "" and isinstance(call.args[0].value, cst.Name) and call.args[0].value.value == x)


def _residual_shape(add_stmt, copy_stmt, norm_stmt, call) -> tuple[str, str, cst.BaseExpression]:
    """(x, r, e) for `x = r + e` (or `e + r`); `r = x`; `x = self.norm(x)`; else Refusal."""
    def assign(stmt):
        if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign):
            a = stmt.body[0]
            if len(a.targets) == 1 and isinstance(a.targets[0].target, cst.Name):
                return a.targets[0].target.value, a.value
        raise Refusal("statements around the norm are not `x = r + h; r = x; x = norm(x)`")
    x, norm_value = assign(norm_stmt)
    r, copied = assign(copy_stmt)
    x2, total = assign(add_stmt)
    require(norm_value is call and len(call.args) == 1 and isinstance(call.args[0].value, cst.Name)
            and call.args[0].value.value == x, "norm is not applied to the variable it assigns")
    require(isinstance(copied, cst.Name) and copied.value == x and x2 == x and r != x, "residual copy not found")
    require(isinstance(total, cst.BinaryOperation) and isinstance(total.operator, cst.Add), "no residual add")
    left, right = total.left, total.right
    if isinstance(left, cst.Name) and left.value == r:
        return x, r, right
    if isinstance(right, cst.Name) and right.value == r:
        return x, r, left
    raise Refusal(f"residual add does not read {r!r}")
