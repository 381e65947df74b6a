"""LM head + loss in a ``*ForCausalLM.forward`` -> fused linear cross-entropy that never builds the logits.

Source shape (every transformers causal LM of this generation), with L the logits variable:

    L = self.lm_head(E)                     # E: the hidden states (sliced by logits_to_keep)
    <statements assigning only L>           # optional transform: Gemma 2 soft-capping, Granite/Cohere scaling
    loss = None
    if labels is not None:
        loss = self.loss_function(..., L, ...)

becomes ``if self.lm_head_loss.fuses(self, labels, E, self.lm_head): L = None; loss = self.lm_head_loss(E,
..., head=self.lm_head, transform=<the transform statements as a function of L>) else: <the original
statements>``. The fused branch runs only while training with labels, autograd on, the loss still
transformers' ``ForCausalLMLoss`` and the head a plain ``nn.Linear``; otherwise, and always without labels,
the original code runs (logits as before). With the fused branch ``outputs.logits`` is None (as with
Liger-Kernel). Proof obligations: the graph has one ``nn.Linear`` child with ``vocab_size`` outputs; the
source has exactly the shape above, and after it L is only passed as a call argument; per instance, the
transform is probed to act on each token's row alone (so chunking over tokens cannot change it).
"""

from __future__ import annotations

import ast

import libcst as cst
import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from fxrewrite import source
from fxrewrite.layers.deferred_head_grad import install_deferred_head_grad
from fxrewrite.layers.lm_head_loss import LMHeadCrossEntropy
from fxrewrite.patterns.base import Context, Match, Pattern, Refusal, free_attribute, require

NEW_NAME = "lm_head_loss"
_TRANSFORM = "__fxrewrite_logits_transform"


def _code(stmts) -> str:
    return cst.Module(body=list(stmts)).code


def _assign(stmt) -> tuple[str, cst.BaseExpression] | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign):
        a = stmt.body[0]
        if len(a.targets) == 1 and isinstance(a.targets[0].target, cst.Name):
            return a.targets[0].target.value, a.value
    return None


def _labels_if(stmt, loss: str) -> tuple[str, cst.Call]:
    """(labels name, loss call) for ``if <labels> is not None: <loss> = self.loss_function(...)``."""
    ok = isinstance(stmt, cst.If) and stmt.orelse is None and isinstance(stmt.test, cst.Comparison)
    ok = ok and len(stmt.test.comparisons) == 1 and isinstance(stmt.test.comparisons[0].operator, cst.IsNot)
    ok = ok and isinstance(stmt.test.left, cst.Name) and isinstance(stmt.test.comparisons[0].comparator, cst.Name)
    ok = ok and stmt.test.comparisons[0].comparator.value == "None" and len(stmt.body.body) == 1
    found = _assign(stmt.body.body[0]) if ok else None
    require(found is not None and found[0] == loss and isinstance(found[1], cst.Call)
            and source.self_attribute(found[1].func) == "loss_function",
            f"no `if labels is not None: {loss} = self.loss_function(...)` after the head")
    return stmt.test.left.value, found[1]


def analyse(tree: cst.Module, head: str):
    """(block, first, last index, L, E, transform statements, labels name, loss call) or Refusal."""
    info = source.collect(tree)
    call = source.unique_self_call(tree, head, info)
    line, block = source.enclosing_statement(info, call)
    found = _assign(line)
    require(found is not None and found[1] is call and len(call.args) == 1 and not call.args[0].keyword
            and not call.args[0].star, f"the head call is not `logits = self.{head}(hidden_states)`")
    name, expr = found[0], call.args[0].value
    body = source.block_statements(block)
    i = next(k for k, s in enumerate(body) if s is line)
    j = i + 1
    while j < len(body) and not (_assign(body[j]) and isinstance(_assign(body[j])[1], cst.Name)
                                 and _assign(body[j])[1].value == "None"):
        require(source.assigned_names(body[j]) <= {name} and not isinstance(body[j], cst.FunctionDef),
                f"statement after the head assigns {sorted(source.assigned_names(body[j]) - {name})}")
        j += 1
    require(j + 1 < len(body), "no `loss = None` after the head")
    loss = _assign(body[j])[0]
    labels, loss_call = _labels_if(body[j + 1], loss)
    uses = [a for a in loss_call.args if isinstance(a.value, cst.Name) and a.value.value == name]
    require(len(uses) == 1 and not uses[0].star and source.collect(loss_call).names >= {name, labels},
            f"self.loss_function does not take {name!r} once as an argument")
    require(sum(1 for a in loss_call.args if name in source.collect(a).names) == 1, f"{name!r} used twice in the loss call")
    _check_later_uses(body[j + 2:], name)
    require(name not in source.collect(cst.Module(body=[cst.Expr(expr)])).names, "the head reads its own output")
    return block, i, j + 1, name, expr, body[i + 1:j], labels, loss_call


def _check_later_uses(stmts, name: str) -> None:
    """After the loss, the logits may only be passed on as a call argument (the output constructor)."""
    for stmt in stmts:
        bad = []

        class V(cst.CSTVisitor):
            def visit_Arg(self, node):
                return not (isinstance(node.value, cst.Name) and node.value.value == name)

            def visit_Name(self, node):
                if node.value == name:
                    bad.append(node)

        stmt.visit(V())
        require(not bad, f"{name!r} is read after the loss other than as a call argument")


def _node_code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def _indent(code: str, prefix: str) -> list[str]:
    return [prefix + ln if ln.strip() else ln for ln in code.strip("\n").splitlines()]


def replacement(original, name, expr, transform, labels, loss_call, head) -> cst.If:
    """``if self.lm_head_loss.fuses(...): <fused> else: <original statements>``, as one statement."""
    e = _node_code(expr)
    args = []
    for a in loss_call.args:
        if isinstance(a.value, cst.Name) and a.value.value == name:
            a = a.with_changes(value=cst.parse_expression(e), keyword=cst.Name("hidden_states") if a.keyword else None)
        args.append(a)
    extra = cst.parse_expression(f"f(head=self.{head}, transform={_TRANSFORM if transform else 'None'})").args
    if args and args[-1].comma is cst.MaybeSentinel.DEFAULT:
        args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    call = loss_call.with_changes(func=cst.parse_expression(f"self.{NEW_NAME}"), args=[*args, *extra])
    loss = _assign(original[-1].body.body[0])[0]
    lines = [f"if self.{NEW_NAME}.fuses(self, {labels}, {e}, self.{head}):"]
    if transform:
        lines += [f"    def {_TRANSFORM}({name}):", *_indent(_code(transform), " " * 8), f"        return {name}"]
    lines += [f"    {name} = None", f"    {loss} = {_node_code(call)}", "else:", *_indent(_code(original), "    ")]
    return cst.parse_statement("\n".join(lines) + "\n")


def probe_transform(fn, module: nn.Module, vocab: int) -> tuple[float, float | None] | None:
    """Refuse unless ``fn(module, logits)`` acts on each token's row alone; then (scale, softcap) when it is
    ``scale * z`` or ``softcap * tanh(z / softcap)`` (what the Triton kernel computes), else None."""
    x = torch.randn(2, 3, vocab, generator=torch.Generator().manual_seed(0)) * 8
    try:
        with torch.no_grad():
            full = fn(module, x.clone())
            rows = torch.stack([torch.stack([fn(module, x[i, j][None, None].clone())[0, 0] for j in range(3)])
                                for i in range(2)])
    except Exception as e:  # noqa: BLE001 - e.g. a transform reading meta parameters: cannot prove it
        raise Refusal(f"cannot probe the logits transform on CPU tensors: {type(e).__name__}: {e}") from e
    require(isinstance(full, torch.Tensor) and full.shape == x.shape and torch.equal(full, rows),
            "the logits transform does not act on each token's logits alone")
    if torch.equal(full, x):
        return 1.0, None
    scale = float((full * x).sum() / (x * x).sum())
    if torch.allclose(full, x * scale, rtol=1e-6, atol=1e-6):
        return scale, None
    with torch.no_grad():
        cap = float(fn(module, torch.full((1, 1, 1), 1e9))[0, 0, 0])
    if 0 < cap < 1e9 and torch.allclose(full, cap * torch.tanh(x / cap), rtol=1e-5, atol=1e-5):
        return 1.0, cap
    return None


_MISSING = object()


def read_values(code: str, module: nn.Module) -> tuple:
    """((path, value), ...) for each ``self.a.b`` the transform statements read whose value on `module` is a
    number, a bool or None (``self.config.logits_scaling``, ``self.config.final_logit_softcapping``): what a proof of
    the transform on this instance assumed (`LMHeadCrossEntropy.params_for` checks them again at each call)."""
    found = []
    for node in ast.walk(ast.parse(code)):
        path = []
        while isinstance(node, ast.Attribute):
            path.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id == "self" and path:
            value = module
            for name in reversed(path):
                value = getattr(value, name, _MISSING)
            if value is None or isinstance(value, (bool, int, float)):  # not _MISSING: a path the code never reaches
                found.append((tuple(reversed(path)), value))
    return tuple(dict.fromkeys(found))


def compile_transform(src: source.ForwardSource, code: str, name: str):
    """``fn(self, L)`` running the transform statements on L, in the forward's globals."""
    text = f"def {_TRANSFORM}(self, {name}):\n" + "\n".join(_indent(code, "    ")) + f"\n    return {name}\n"
    namespace: dict = {}
    exec(compile(text, src.filename, "exec"), src.globals, namespace)  # noqa: S102 - the model's own statements
    return namespace[_TRANSFORM]


class LMHeadLossPattern(Pattern):
    """See module docstring."""

    name = "lm_head_loss"

    @classmethod
    def match(cls, traced, ctx: Context) -> list[Match]:
        vocab = getattr(ctx.config, "vocab_size", None)
        root = traced.module
        heads = [n for n in traced.graph.nodes if n.op == "call_module" and "." not in n.target
                 and type(root.get_submodule(n.target)) is nn.Linear
                 and root.get_submodule(n.target).out_features == vocab]
        if len(heads) != 1 or "loss_function" not in dir(type(root)):
            return []
        tree = source.ForwardSource.recover(type(root)).tree
        found = analyse(tree, heads[0].target)
        facts = (("transform", _code(found[5])), ("logits", found[3]), ("vocab", vocab))
        return [Match(cls, frozenset({heads[0].name}), (("head", heads[0].target),), facts)]

    @classmethod
    def rewrite(cls, match: Match, src, tree: cst.Module) -> cst.Module:
        block, i, last, name, expr, transform, labels, loss_call = analyse(tree, match.name("head"))
        body = source.block_statements(block)
        new = replacement(body[i:last + 1], name, expr, transform, labels, loss_call, match.name("head"))
        new = new.with_changes(leading_lines=body[i].leading_lines)
        return tree.deep_replace(block, block.with_changes(body=[*body[:i], new, *body[last + 1:]]))

    @classmethod
    def validate(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        free_attribute(module, NEW_NAME)
        head = getattr(module, match.name("head"), None)
        require(type(head) is nn.Linear and head.out_features == match.fact("vocab"),
                f"{match.name('head')} is not an nn.Linear with vocab_size outputs on this instance")
        require(getattr(module, "loss_function", None) is ForCausalLMLoss,
                "the loss function is not transformers' ForCausalLMLoss")
        params, depends = (1.0, None), ()
        if match.fact("transform").strip():
            fn = compile_transform(source.ForwardSource.recover(type(module)), match.fact("transform"),
                                   match.fact("logits"))
            params = probe_transform(fn, module, min(match.fact("vocab"), 64))
            depends = read_values(match.fact("transform"), module)
        module.__dict__["_fxrewrite_lm_loss_params"] = params, depends

    @classmethod
    def build(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        config = getattr(module, "config", None)
        inter = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                        "intermediate_size", None)
        params, depends = module.__dict__.pop("_fxrewrite_lm_loss_params", (None, ()))
        loss = LMHeadCrossEntropy(params, intermediate_size=inter if isinstance(inter, int) else None, depends=depends)
        setattr(module, NEW_NAME, loss)
        install_deferred_head_grad(module, loss)  # the head's weight gradient made after the layers' backward

    @classmethod
    def describe(cls, match: Match) -> str:
        extra = " (with its logits transform)" if match.fact("transform").strip() else ""
        return f"{match.name('head')} + loss_function -> {NEW_NAME}{extra}"
