"""Gated MLP: act(gate(x)) * up(x) -> `MergedColumnParallelLinear` (gate|up) + `SiluAndMul`/`GeluAndMul`.

Found by dataflow: a product of two plain linears reading the same input, one of them through
an activation. The activation is identified by what it computes (a module is probed against
silu / gelu / gelu-tanh for exact equality; a functional call by its target), never by name.
Phi-3's single ``gate_up_proj`` chunked in two along the last dim: when the halves are proven to meet only in
``act(half) * other half``, the module keeps it and records it (`PREFUSED_ATTR`) for tensor parallelism to shard as
[gate | up] (`fxrewrite.sharding`); otherwise it is reported as present.
"""

from __future__ import annotations

import operator

import libcst as cst
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fxrewrite import nodes, source
from fxrewrite.layers.activation import SOURCE_ACT_ATTR, GeluAndMul, SiluAndMul
from fxrewrite.layers.gated_mlp import GATED_MLP_ATTR
from fxrewrite.layers.linear import MergedColumnParallelLinear
from fxrewrite.patterns import feature_path
from fxrewrite.patterns.base import (PREFUSED_ATTR, Context, Match, Pattern, copy_requires_grad, free_attribute,
                                     require, require_same_requires_grad, require_unshared)

NEW_LINEAR, NEW_ACT = "gate_up_proj", "act_and_mul"
_ACTS = {"silu": lambda x: F.silu(x), "gelu": lambda x: F.gelu(x), "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def probe_activation(module: nn.Module) -> str | None:
    """'silu' / 'gelu' / 'gelu_tanh' when `module` computes exactly that in train and in eval mode, else None (a
    dropout inside, idle in eval mode, would be dropped in train mode by the fused kernel). An in-place one
    (``nn.SiLU(inplace=True)``) counts: it overwrites the gate's output, which nothing else reads (the pattern
    requires the activation to be its only user), so the fused kernel computes the same product."""
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        return None
    x = torch.linspace(-8.0, 8.0, 401)
    try:
        ys = _in_both_modes(module, x)
    except Exception:  # noqa: BLE001 - not an elementwise activation
        return None
    return next((k for k, f in _ACTS.items()
                 if all(isinstance(y, torch.Tensor) and torch.equal(y, f(x)) for y in ys)), None)


def _in_both_modes(module: nn.Module, x: torch.Tensor) -> list:
    """[module(x) as it is, module(x) with every submodule's training flag flipped]: each flag is put back after, and
    the global RNG state too (a dropout in train mode draws from it); x itself is never changed (clones in)."""
    flags = [(m, m.training) for m in module.modules()]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            ys = [module(x.clone())]
            module.train(not module.training)
            return ys + [module(x.clone())]
    finally:
        for m, flag in flags:
            m.training = flag


def _functional_act(node) -> str | None:
    if nodes.is_op(node, F.silu, torch.nn.functional.silu):
        return "silu"
    if nodes.is_op(node, F.gelu):
        return "gelu_tanh" if node.kwargs.get("approximate") == "tanh" else "gelu"
    return None


def _act_kind(node, root: nn.Module) -> str | None:
    if node.op == "call_module" and len(node.args) == 1 and not node.kwargs:
        return probe_activation(root.get_submodule(node.target))
    return _functional_act(node)


def _chunk_product(chunk, root: nn.Module):
    """The product node of ``a, b = y.chunk(2, dim=-1)`` then ``act(a) * b`` (either side), each half and the
    activation read once; else None."""
    dim = chunk.kwargs.get("dim", chunk.args[2] if len(chunk.args) > 2 else 0)
    val = nodes.meta(chunk.args[0])
    if dim != -1 and not (val is not None and dim == val.dim() - 1):
        return None
    halves = list(chunk.users)
    if len(halves) != 2 or {h.args[1] for h in halves if nodes.is_op(h, operator.getitem)} != {0, 1}:
        return None
    if any(len(h.users) != 1 for h in halves):
        return None
    for act, other in (halves, halves[::-1]):
        (act_call,) = act.users
        if _act_kind(act_call, root) is None or len(act_call.users) != 1 or act_call.args[:1] != (act,):
            continue
        (mul,) = act_call.users
        if nodes.is_op(mul, operator.mul, torch.mul) and set(mul.args) == {act_call, other} and len(mul.args) == 2:
            return mul
    return None


def _partner_facts(product: fx.Node, root, stopped: str | None = None) -> tuple:
    """("row_partner", the linear reading the product, proven feature by feature), ("row_partner_why", why not)."""
    partner, why = feature_path.row_partner([product], root, stopped=stopped)
    return ("row_partner", partner), ("row_partner_why", why)


def _already_fused(traced) -> list[Match]:
    found, root = [], traced.module
    for n in traced.graph.nodes:
        chunk = next(iter(n.users), None) if nodes.is_linear(n, root) and len(n.users) == 1 else None
        if chunk is not None and nodes.is_op(chunk, "chunk") and chunk.args[1:2] == (2,):
            mul = _chunk_product(chunk, root) if "." not in n.target else None
            facts = (("prefused", True), *_partner_facts(mul, root, traced.error)) if mul is not None else ()
            found.append(Match(GLUPattern, frozenset({n.name, chunk.name}), (("gate_up", n.target),), facts,
                               present=mul is None))
    return found


def _whole_forward(traced, gate, up, act, mul, partner: str | None) -> bool:
    """Whether the class's forward is exactly ``return down(act(gate(x)) * up(x))``: by dataflow (no node but the
    input, the four matched ones, the down call and the output; the output is the down call's result) and by source
    (its body, a docstring aside, is ``return E`` or ``v = E; return v``, and E is ``self.<down>(...)`` of nothing
    but calls of the matched children or of the activation function, products and x: no statement, branch or
    other call the trace cannot see). The decoder-layer fold (`fxrewrite.layers.gated_mlp`) may then call the
    children in place of the forward."""
    users = list(mul.users)
    down = users[0] if len(users) == 1 else None
    if partner is None or down is None or down.op != "call_module" or down.target != partner or down.args != (mul,) \
            or down.kwargs:
        return False
    x = gate.args[0]
    rest = [n for n in traced.graph.nodes if n not in (x, gate, up, act, mul, down)]
    if not (getattr(x, "op", None) == "placeholder" and len(rest) == 1 and rest[0].op == "output"
            and rest[0].args == (down,)):
        return False
    try:
        body = list(source.ForwardSource.recover(type(traced.module)).function.body.body)
    except source.SourceError:
        return False
    if body and _is_docstring(body[0]):
        body = body[1:]
    if len(body) == 1 and _single(body[0], cst.Return):
        value = body[0].body[0].value
    elif len(body) == 2 and _single(body[0], cst.Assign) and _single(body[1], cst.Return):
        assign, ret = body[0].body[0], body[1].body[0]
        if not (len(assign.targets) == 1 and isinstance(assign.targets[0].target, cst.Name)
                and isinstance(ret.value, cst.Name) and ret.value.value == assign.targets[0].target.value):
            return False
        value = assign.value
    else:
        return False
    children = {gate.target, up.target, partner} | ({act.target} if act.op == "call_module" else set())
    return (isinstance(value, cst.Call) and source.self_attribute(value.func) == partner
            and _glu_expression(value, children, x.target))


_ACT_FUNCTIONS = {f"{prefix}{name}" for prefix in ("F.", "nn.functional.", "torch.nn.functional.")
                  for name in ("silu", "gelu")}


def _glu_expression(expr, children: set, x: str) -> bool:
    """`expr` is built only of x, products, calls of ``self.<child>`` for the given children, and calls of
    silu / gelu (``F.``, ``nn.functional.``, ``torch.nn.functional.``; string keyword arguments, as gelu's
    ``approximate``): no conditional, attribute read, subscript or other call."""
    if isinstance(expr, cst.Name):
        return expr.value == x
    if isinstance(expr, cst.BinaryOperation):
        return (isinstance(expr.operator, cst.Multiply) and _glu_expression(expr.left, children, x)
                and _glu_expression(expr.right, children, x))
    if not isinstance(expr, cst.Call) or any(a.star for a in expr.args):
        return False
    if source.self_attribute(expr.func) in children:
        return all(a.keyword is None and _glu_expression(a.value, children, x) for a in expr.args)
    if _dotted(expr.func) in _ACT_FUNCTIONS:
        return all(_glu_expression(a.value, children, x) if a.keyword is None else isinstance(a.value, cst.SimpleString)
                   for a in expr.args)
    return False


def _dotted(expr) -> str | None:
    """"a.b.c" for the expression ``a.b.c``, else None."""
    if isinstance(expr, cst.Name):
        return expr.value
    if isinstance(expr, cst.Attribute):
        head = _dotted(expr.value)
        return None if head is None else f"{head}.{expr.attr.value}"
    return None


def _single(stmt, kind) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], kind)


def _is_docstring(stmt) -> bool:
    return (_single(stmt, cst.Expr) and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString)))


def _down_call(info, product, partner: str | None):
    """The call ``self.<partner>(product)`` when the product goes straight, alone, into the row partner."""
    arg = source.parent(info, product)
    call = source.parent(info, arg) if isinstance(arg, cst.Arg) else None
    if (partner is None or not isinstance(call, cst.Call) or source.self_attribute(call.func) != partner
            or len(call.args) != 1 or arg.keyword is not None or arg.star):
        return None
    return call


class GLUPattern(Pattern):
    """``act(gate(x)) * up(x)`` -> ``self.act_and_mul(self.gate_up_proj(x))`` (Shazeer 2020, "GLU Variants
    Improve Transformer"; vLLM's `MergedColumnParallelLinear` + `SiluAndMul`); ``down(act(gate(x)) * up(x))``
    -> ``self.act_and_mul(self.gate_up_proj(x), self.down)`` (a training backward that recomputes the product).

    Facts: act ("silu", "gelu", "gelu_tanh"), act_is_module, row_partner (the linear reading the product),
    whole_forward (the forward is nothing but ``down(act(gate(x)) * up(x))``: `_whole_forward`)."""

    name = "glu"

    @classmethod
    def match(cls, traced, ctx: Context) -> list[Match]:
        """Products of two plain linears on one input, one through silu/gelu; `Refusal`: gate/up wrapped (LoRA),
        other act, gate != up."""
        matches, root = _already_fused(traced), traced.module
        for mul in traced.graph.nodes:
            if not nodes.is_op(mul, operator.mul, torch.mul) or len(mul.args) != 2:
                continue
            for act, up in (mul.args, mul.args[::-1]):
                gate = act.args[0] if getattr(act, "op", None) in ("call_module", "call_function") and act.args else None
                if not (gate is not None and hasattr(gate, "op") and hasattr(up, "op")
                        and nodes.is_linear_like(gate, root) and nodes.is_linear_like(up, root)
                        and gate.args == up.args and len(gate.users) == 1 and len(up.users) == 1
                        and len(act.users) == 1):
                    continue
                wrapped = [why for why in (nodes.wrapped_linear(gate, root), nodes.wrapped_linear(up, root)) if why]
                require(not wrapped, f"{'; '.join(wrapped)}: gate/up kept unfused")
                kind = _act_kind(act, root)
                require(kind is not None, f"activation {act.target} is not silu/gelu/gelu_tanh")
                gm, um = root.get_submodule(gate.target), root.get_submodule(up.target)
                require(gm.out_features == um.out_features, "gate and up sizes differ")
                require((gm.bias is None) == (um.bias is None), "gate and up disagree on bias")
                names = (("gate", gate.target), ("up", up.target), ("act", str(act.target)))
                claimed = frozenset({mul.name, act.name, gate.name, up.name})
                partner = _partner_facts(mul, root, traced.error)
                whole = not traced.partial and _whole_forward(traced, gate, up, act, mul, partner[0][1])
                facts = (("act", kind), ("act_is_module", act.op == "call_module"), *partner,
                         ("whole_forward", bool(whole)))
                matches.append(Match(cls, claimed, names, facts))
                break
        return matches

    @classmethod
    def rewrite(cls, match: Match, src, tree: cst.Module) -> cst.Module:
        """``act(self.gate(x)) * self.up(x)`` -> the fused call; `Refusal` unless one expression over one variable.
        A pre-fused projection keeps its source."""
        if match.fact("prefused"):
            return tree
        info = source.collect(tree)
        gate = source.unique_self_call(tree, match.name("gate"), info)
        up = source.unique_self_call(tree, match.name("up"), info)
        arg = source.parent(info, gate)
        act = source.parent(info, arg)
        product = source.parent(info, act)
        require(isinstance(act, cst.Call) and act.args and act.args[0].value is gate
                and all(a.keyword for a in act.args[1:]), "gate output is not passed straight to the activation")
        require(isinstance(product, cst.BinaryOperation) and isinstance(product.operator, cst.Multiply)
                and up in (product.left, product.right), "act(gate(x)) * up(x) is not one expression")
        if match.fact("act_is_module"):
            require(source.self_attribute(act.func) == match.name("act"), "activation call is not self.<act>(...)")
        x = [a.value for a in gate.args]
        require(len(x) == 1 and len(up.args) == 1 and x[0].deep_equals(up.args[0].value), "gate and up inputs differ")
        require(isinstance(x[0], cst.Name), "gate/up input is not a variable")
        down = _down_call(info, product, match.fact("row_partner"))
        if down is not None:  # down(act(x)) as one call: its training backward recomputes act(x) (a [N, d] less)
            call = f"self.{NEW_ACT}(self.{NEW_LINEAR}({x[0].value}), self.{source.self_attribute(down.func)})"
            new = cst.parse_expression(call)
            return tree.deep_replace(down, new.with_changes(lpar=down.lpar, rpar=down.rpar))
        new = cst.parse_expression(f"self.{NEW_ACT}(self.{NEW_LINEAR}({x[0].value}))")
        return tree.deep_replace(product, new.with_changes(lpar=product.lpar, rpar=product.rpar))

    @classmethod
    def validate(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        """gate/up are plain equal-shaped `nn.Linear` here, the activation probes the same, new names are free
        (pre-fused: one plain linear of an even width)."""
        if match.fact("prefused"):
            lin = getattr(module, match.name("gate_up"), None)
            require(type(lin) is nn.Linear and lin.out_features % 2 == 0,
                    f"{match.name('gate_up')} is not an nn.Linear of an even width on this instance")
            return
        gate, up = getattr(module, match.name("gate"), None), getattr(module, match.name("up"), None)
        require(type(gate) is nn.Linear and type(up) is nn.Linear, "gate/up are not nn.Linear on this instance")
        require(gate.in_features == up.in_features and gate.out_features == up.out_features, "gate/up shapes differ")
        require((gate.bias is None) == (up.bias is None), "gate and up disagree on bias")
        require_same_requires_grad({match.name("gate"): gate, match.name("up"): up})
        require_unshared(ctx, module, {match.name("gate"): gate, match.name("up"): up})
        if match.fact("act_is_module"):
            kind = probe_activation(getattr(module, match.name("act")))
            require(kind == match.fact("act"), f"activation of this instance is {kind}, not {match.fact('act')}")
        for name in (NEW_LINEAR, NEW_ACT):
            free_attribute(module, name)

    @classmethod
    def build(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        """Set ``gate_up_proj`` [2*I, H] (gate rows, then up; old dtype/device) and ``act_and_mul``; delete gate/up.
        A pre-fused projection stays; `PREFUSED_ATTR` records it with its row partner."""
        if match.fact("prefused"):
            half = getattr(module, match.name("gate_up")).out_features // 2
            facts = {"sizes": [half, half], "row_partner": match.fact("row_partner"),
                     "row_partner_why": match.fact("row_partner_why")}
            module.__dict__.setdefault(PREFUSED_ATTR, []).append(("merged", match.name("gate_up"), facts))
            return
        gate, up = getattr(module, match.name("gate")), getattr(module, match.name("up"))
        fused = MergedColumnParallelLinear(gate.in_features, [gate.out_features, up.out_features],
                                           bias=gate.bias is not None, params_dtype=gate.weight.dtype,
                                           device=gate.weight.device)
        for shard, lin in enumerate((gate, up)):
            fused.weight.weight_loader(fused.weight, lin.weight.detach(), shard)
            if lin.bias is not None:
                fused.bias.weight_loader(fused.bias, lin.bias.detach(), shard)
        copy_requires_grad(fused, gate, up)
        fused.row_partner, fused.row_partner_why = match.fact("row_partner"), match.fact("row_partner_why")
        if match.fact("whole_forward"):  # the decoder layer may fold its norm and residual adds around it
            module.__dict__[GATED_MLP_ATTR] = (NEW_LINEAR, NEW_ACT, match.fact("row_partner"))
        kind = match.fact("act")
        # the fused gate_up output is new and read only by the activation: its backward may overwrite it
        act = (SiluAndMul(inplace_backward=True) if kind == "silu"
               else GeluAndMul("tanh" if kind == "gelu_tanh" else "none", inplace_backward=True))
        if match.fact("act_is_module"):  # a hook put on it later runs, or a module put in its place (not registered:
            # no second module path; the MLP held in a plain dict entry, no cycle in modules())
            act.__dict__[SOURCE_ACT_ATTR] = (module, match.name("act"), getattr(module, match.name("act")))
        delattr(module, match.name("gate"))
        delattr(module, match.name("up"))
        setattr(module, NEW_LINEAR, fused)
        setattr(module, NEW_ACT, act)

    @classmethod
    def describe(cls, match: Match) -> str:
        """``gate_proj,up_proj -> gate_up_proj + silu_and_mul`` (or ``(already fused)``)."""
        if match.present:
            return f"{match.name('gate_up')} (already fused)"
        if match.fact("prefused"):
            return f"{match.name('gate_up')} (already fused; act(gate) * up)"
        return f"{match.name('gate')},{match.name('up')} -> {NEW_LINEAR} + {match.fact('act')}_and_mul"

    @classmethod
    def shards(cls, match: Match):
        """gate -> shard 0, up -> shard 1 of ``gate_up_proj``."""
        if match.present or match.fact("prefused"):
            return []
        return [(NEW_LINEAR, [(match.name("gate"), 0), (match.name("up"), 1)])]
