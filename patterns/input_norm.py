"""Input norm into the attention's QKV projection: in a decoder layer, ``x = self.input_layernorm(x)`` followed by
``... = self.self_attn(hidden_states=x, ...)`` -> ``... = self.input_layernorm.forward_into(self.self_attn,
hidden_states=x, ...)``, so that at decode the norm runs inside qkv_proj's skinny GEMV (as the native decoder layers'
``qkv_proj.norm_forward``; `fxrewrite.layers.input_norm`).

Found by dataflow: a fused `RMSNorm` child applied to the layer's input (a forward parameter, so no residual add
feeds it: that form is `ResidualRMSNormPattern`'s), whose result only an attention child reads, once, as the argument
of the parameter the QKV rewrite proved only its q/k/v projections read (`NORMED_INPUT_ATTR`: by keyword, or first
when it is the first parameter). Source: the norm statement rebinds its own input's name x, the attention call is the
next statement, reads x once (as that argument) and its statement rebinds x, so no later read, on any path, sees the
un-normalised value the rewritten code leaves in x before the call.
"""

from __future__ import annotations

import libcst as cst
import torch.fx as fx
from torch import nn

from fxrewrite import source
from fxrewrite.layers.fold_guard import runs_bound_forward
from fxrewrite.layers.input_norm import NORMED_INPUT_ATTR
from fxrewrite.layers.layernorm import RMSNorm
from fxrewrite.patterns.base import Context, Match, Pattern, require


def _proven_attention(child) -> bool:
    """`child` reads its input only through its fused QKV projection (`NORMED_INPUT_ATTR`) and still runs the forward
    fxrewrite bound to it."""
    return isinstance(child, nn.Module) and NORMED_INPUT_ATTR in child.__dict__ and runs_bound_forward(child)


def _uses(node, target) -> int:
    """How many times `target` appears among `node`'s arguments (nested tuples, lists and dicts included)."""
    count = 0

    def visit(a):
        nonlocal count
        count += a is target

    fx.node.map_arg((node.args, node.kwargs), visit)
    return count


class InputNormPattern(Pattern):
    """``x = self.norm(x); ... = self.attn(..., hidden_states=x, ...)`` -> ``... = self.norm.forward_into(self.attn,
    ..., hidden_states=x, ...)``. Facts: input_param (the attention's parameter that gets x), input_position (its
    position after self)."""

    name = "input_norm"

    @classmethod
    def match(cls, traced, ctx: Context) -> list[Match]:
        """Each direct fused `RMSNorm` call on a forward parameter whose one reader is a proven attention child."""
        matches, root = [], traced.module
        for norm in traced.graph.nodes:
            if norm.op != "call_module" or "." in norm.target or len(norm.args) != 1 or norm.kwargs:
                continue
            if not isinstance(root.get_submodule(norm.target), RMSNorm) or norm.args[0].op != "placeholder":
                continue
            users = list(norm.users)
            attn = users[0] if len(users) == 1 else None
            if attn is None or attn.op != "call_module" or "." in attn.target or _uses(attn, norm) != 1:
                continue
            child = root.get_submodule(attn.target)
            if not _proven_attention(child):
                continue
            param, _, position = child.__dict__[NORMED_INPUT_ATTR]
            first = position == 0 and attn.args[:1] == (norm,) and param not in attn.kwargs
            if attn.kwargs.get(param) is not norm and not first:  # the normed x must be that parameter's argument
                continue
            names = (("norm", norm.target), ("consumer", attn.target))
            matches.append(Match(cls, frozenset({norm.name}), names, (("input_param", param),
                                                                     ("input_position", position))))
        return matches

    @classmethod
    def rewrite(cls, match: Match, src, tree: cst.Module) -> cst.Module:
        """The norm statement -> a comment line; the attention call -> ``self.<norm>.forward_into(self.<attn>, ...)``
        (same arguments); `Refusal` unless the statements are ``x = self.norm(x)`` and, next, the call reading x."""
        info = source.collect(tree)
        norm_name, attn_name, param = match.name("norm"), match.name("consumer"), match.fact("input_param")
        norm_call = source.unique_self_call(tree, norm_name, info)
        attn_call = source.unique_self_call(tree, attn_name, info)
        norm_stmt, block = source.enclosing_statement(info, norm_call)
        attn_stmt, attn_block = source.enclosing_statement(info, attn_call)
        body = source.block_statements(block)
        i = next(k for k, s in enumerate(body) if s is norm_stmt)
        require(attn_block is block and i + 1 < len(body) and body[i + 1] is attn_stmt,
                f"self.{attn_name}(...) is not the statement after self.{norm_name}(...)")
        x = _rebinding(norm_stmt, norm_call)
        require(x is not None, f"the norm statement is not `x = self.{norm_name}(x)`")
        # after the rewrite x holds the un-normalised value: only the call may read it, once, and the call's statement
        # must rebind it (a later read, even on a path the trace did not take, then sees what it saw before)
        require(len(attn_stmt.body) == 1 and isinstance(attn_stmt.body[0], cst.Assign)
                and attn_stmt.body[0].value is attn_call and x in source.assigned_names(attn_stmt),
                f"the statement of self.{attn_name}(...) does not assign {x} from the call")
        given = [a for a in attn_call.args if (a.keyword.value if a.keyword else None) == param]
        positional = match.fact("input_position") == 0 and attn_call.args and attn_call.args[0].keyword is None
        arg = given[0] if given else (attn_call.args[0] if positional else None)
        require(arg is not None and not arg.star and isinstance(arg.value, cst.Name) and arg.value.value == x,
                f"self.{attn_name}(...) does not take {x} as {param}")
        reads = [n for a in attn_call.args for n in _names_in(a.value)]
        require(reads.count(x) == 1, f"self.{attn_name}(...) reads {x} more than once")
        head = cst.Arg(cst.parse_expression(f"self.{attn_name}"),
                       comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        new_call = attn_call.with_changes(func=cst.parse_expression(f"self.{norm_name}.forward_into"),
                                          args=[head, *attn_call.args])
        note = cst.EmptyLine(comment=cst.Comment(f"# fxrewrite: {x} = self.{norm_name}({x}) is in the call below"))
        new_stmt = attn_stmt.deep_replace(attn_call, new_call)
        new_stmt = new_stmt.with_changes(leading_lines=[*norm_stmt.leading_lines, note, *attn_stmt.leading_lines])
        return tree.deep_replace(block, block.with_changes(body=[*body[:i], new_stmt, *body[i + 2:]]))

    @classmethod
    def validate(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        """The norm is a fused `RMSNorm` and the attention proven (`NORMED_INPUT_ATTR`, its bound forward) on this
        instance."""
        require(isinstance(getattr(module, match.name("norm"), None), RMSNorm), "norm child is not a fused RMSNorm")
        attn = getattr(module, match.name("consumer"), None)
        spec = attn.__dict__.get(NORMED_INPUT_ATTR) if _proven_attention(attn) else None
        require(spec is not None and (spec[0], spec[2]) == (match.fact("input_param"), match.fact("input_position")),
                f"{match.name('consumer')} does not read its input through its qkv_proj alone on this instance")

    @classmethod
    def build(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        """Only the source changes; the attention's qkv_proj is marked as called through `norm_forward` (the load-time
        GEMV tuner times that kind)."""
        attn = getattr(module, match.name("consumer"))
        getattr(attn, attn.__dict__[NORMED_INPUT_ATTR][1]).gemv_prologue = "norm"

    @classmethod
    def describe(cls, match: Match) -> str:
        """``input_layernorm -> self_attn qkv_proj``."""
        return f"{match.name('norm')} -> {match.name('consumer')} qkv_proj"


def _names_in(expr) -> list[str]:
    """Every `Name` read in `expr` (with repeats)."""
    found = []

    class V(cst.CSTVisitor):
        def visit_Name(self, node):
            found.append(node.value)

    expr.visit(V())
    return found


def _rebinding(stmt, call) -> str | None:
    """x for the statement ``x = self.<norm>(x)`` whose value is `call`, else None."""
    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign)):
        return None
    a = stmt.body[0]
    if len(a.targets) != 1 or not isinstance(a.targets[0].target, cst.Name) or a.value is not call:
        return None
    x = a.targets[0].target.value
    ok = (len(call.args) == 1 and call.args[0].keyword is None and not call.args[0].star
          and isinstance(call.args[0].value, cst.Name) and call.args[0].value.value == x)
    return x if ok else None
