"""Per-head q/k RMSNorm + rotary: ``q = q_norm(view(q_proj(x))).transpose(1, 2)``, the same for k, then
``apply_rotary_pos_emb(q, k, cos, sin)`` -> one ``self.qk_norm_rope(q, k, cos, sin, q_norm=..., k_norm=...)``.

Formula (transformers ``Qwen3Attention.forward``): each head's D features are normalised by the Llama
RMSNorm ``w * (x * rsqrt(mean(x², -1) + eps)).to(dtype)``, then rotated (neox). The match, on the
attention graph, is a rotary-apply call (proved neox by `RotaryApplyPattern`'s probe) whose q and k are
each (a transpose, last dim kept, of) the only use of a child module; the proof is that both children
are fused Llama-form `RMSNorm` (`RMSNormPattern` replaced and proved them before this class is matched)
with head_dim-sized weights. The source edit drops the two norm calls and passes the norms to the fused
op, so ``q_norm.weight`` / ``k_norm.weight`` keep their Hugging Face names (and stay replicated under
tensor parallelism). At inference on a GPU the op is the Triton kernel `fxrewrite.kernels.qk_norm_rope`,
in place when the norms' inputs are provably fresh projection outputs, else on one copy. When the graph
shows that the attention call alone reads the rotated q and k and its values (``attention(self, q, k, v)``),
the rewrite also passes ``value=v``: in a serving-engine step the op then writes k and v into the layer's
paged cache from the same launch (`fxrewrite.kernels.qk_norm_rope_cache`, as the native Qwen3 does) and
the engine's attention skips its own write for exactly those tensors (`fxrewrite.layers.kv_context`).
"""

from __future__ import annotations

import libcst as cst
import torch
import torch.fx as fx
from torch import nn

from fxrewrite import nodes, source, tracer
from fxrewrite.kernels.batch_invariant import is_batch_invariant
from fxrewrite.kernels import compiled_training_kernels, use_triton
from fxrewrite.kernels.qk_norm_rope import qk_norm_rope_triton
from fxrewrite.kernels.qk_norm_rope_cache import qk_norm_rope_cache_triton
from fxrewrite.kernels.qk_norm_rope_backward import fits
from fxrewrite.kernels.qk_norm_rope_op import qk_norm_rope_fused
from fxrewrite.kernels.rotary_backward import rotary_apply_train
from fxrewrite.layers.kv_context import layer_kv_cache, mark_kv_written
from fxrewrite.layers.fold_guard import unhooked
from fxrewrite.layers.layernorm import RMSNorm, note_rewritten_call
from fxrewrite.patterns.base import Context, Match, Pattern, Refusal, free_attribute, require
from fxrewrite.patterns.rotary_calls import (apply_calls, apply_rotary_qk, calls_of, fused_norms, kernel_applies,
                                             norm_refusal, packed_cos_sin, unique_call)

NEW_NAME = "qk_norm_rope"
_ROLES = ("q_norm", "k_norm")
_VIEWS = frozenset({"view", "reshape"})


class QKNormRotaryEmb(nn.Module):
    """``forward(q, k, cos, sin, unsqueeze_dim=1, *, q_norm, k_norm, value=None) -> (q, k)``, rotated after the norms.

    q [B, Hq, S, D], k [B, Hk, S, D] (un-normalised), cos/sin [B, S, rotary_dim] (neox: halves repeated);
    q_norm / k_norm are the attention's own `RMSNorm` children (weight [D]). The torch form (CPU, batch > 1)
    is ``apply_rotary_qk(q_norm(q), k_norm(k), cos, sin)``, transformers' computation op for op; while
    autograd records on CUDA, one Triton kernel each way (`fxrewrite.kernels.qk_norm_rope_backward`; else the
    norms' and the rotary's training kernels). Inference on a GPU with one batch row (the engine's flattened tokens) runs the Triton
    kernel `qk_norm_rope` (float32 math, Llama's roundings): on q and k themselves when ``inplace`` (set only
    when the pattern proved nothing else reads them), else on copies. With `layer_idx` (the attention's
    layer) and ``value`` [1, Hk, S, D] inside a serving-engine step, that kernel also writes the rotated k
    and the value into the layer's paged cache (`fxrewrite.layers.kv_context`); ``value`` is otherwise unused.
    """

    def __init__(self, inplace: bool = False, layer_idx: int | None = None) -> None:
        super().__init__()
        self.inplace = inplace
        self.layer_idx = layer_idx

    def forward(self, q, k, cos, sin, unsqueeze_dim: int = 1, *, q_norm: RMSNorm, k_norm: RMSNorm, value=None):
        """q [B, Hq, S, D], k [B, Hk, S, D], cos/sin [B, S, rotary_dim] -> (q, k) normalised, rotated; q's dtype."""
        invariant = is_batch_invariant()  # the engine normalises and rotates as the trainer does
        fused = unhooked(q_norm, k_norm)  # a hook on a norm sees its call: the norms' own forwards run
        if fused and self._kernel_applies(q, k, cos, unsqueeze_dim, q_norm, k_norm) and not invariant:
            return self._kernel(q, k, cos, sin, q_norm, k_norm, value)
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, q_norm.weight, k_norm.weight))
        kernels = use_triton(q) or compiled_training_kernels(q)  # eager, or custom ops under torch.compile
        if fused and training and not invariant and kernels and self._llama_form(q_norm, k_norm) and fits(
                q, k, cos, sin, q_norm.weight, k_norm.weight, unsqueeze_dim):  # one Triton kernel each way
            return qk_norm_rope_fused(q, k, cos, sin, q_norm.weight, k_norm.weight, q_norm.variance_epsilon,
                                      k_norm.variance_epsilon, True)
        q, k = q_norm(q), k_norm(k)
        if invariant or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):  # training: Triton fwd + bwd
            return rotary_apply_train(q, k, cos, sin, unsqueeze_dim)
        return apply_rotary_qk(q, k, cos, sin, unsqueeze_dim)

    @staticmethod
    def _llama_form(q_norm, k_norm) -> bool:
        return all(n.offset == 0.0 and n.upcast for n in (q_norm, k_norm))

    @staticmethod
    def _kernel_applies(q, k, cos, unsqueeze_dim, q_norm, k_norm) -> bool:
        weights = (q_norm.weight, k_norm.weight)
        # the kernel has no backward, takes one eps, and writes q's dtype (no promotion by the weight)
        return (kernel_applies(q, k, cos, unsqueeze_dim)
                and not (torch.is_grad_enabled() and any(w.requires_grad for w in weights))
                and q_norm.variance_epsilon == k_norm.variance_epsilon and k.dtype == q.dtype
                and all(w.dtype == q.dtype and w.shape == (q.shape[-1],) for w in weights))

    def _kernel(self, q, k, cos, sin, q_norm, k_norm, value=None):
        positions, cache, settled = packed_cos_sin(cos, sin)
        if not self.inplace:
            q, k = q.clone(), k.clone()
        tokens_q, tokens_k = q[0].transpose(0, 1), k[0].transpose(0, 1)  # [S, H, D] views
        norm_rope = (q_norm.weight, k_norm.weight, q_norm.variance_epsilon, q.shape[-1], cache, True)
        target = self._kv_target(k, value)
        if target is None:
            qk_norm_rope_triton(positions, tokens_q, tokens_k, *norm_rope)
        else:  # one launch fewer per layer: k and v go to the paged cache from the norm-rope kernel
            # settled: the kernel may read positions and the table before it waits on the previous one (as the
            # native model's; the slot mapping and norm weights are the step's metadata and constants)
            qk_norm_rope_cache_triton(positions, tokens_q, tokens_k, value[0].transpose(0, 1), *norm_rope, *target,
                                      static_metadata=settled)
            mark_kv_written(self.layer_idx, k, value)
        return q, k

    def _kv_target(self, k, value):
        """The layer's (key_cache, value_cache, slot_mapping) in the running engine step when `value` is laid
        out like k, else None. (``self.layer_idx`` is only passed on: instances of other layers share a trace.)"""
        if not isinstance(value, torch.Tensor) or value.shape != k.shape or value.dtype != k.dtype or \
                value.device != k.device or value.stride(-1) != 1:
            return None
        return layer_kv_cache(self.layer_idx)

    def extra_repr(self) -> str:
        """``inplace=...`` in the module's repr."""
        return f"inplace={self.inplace}"


def _fresh_input(norm: fx.Node, traced) -> bool:
    """Whether the norm reads a view of a plain linear's output that nothing else can read, in the graph
    (single users) and in the source (the projection call sits inline in the norm call, never named)."""
    view = norm.args[0]
    if not (nodes.is_op(view, *_VIEWS) and len(view.users) == 1):
        return False
    proj = view.args[0]
    if not (isinstance(proj, fx.Node) and nodes.is_linear(proj, traced.module) and len(proj.users) == 1):
        return False
    try:
        call = source.unique_self_call(source.ForwardSource.recover(type(traced.module)).tree, norm.target)
    except source.SourceError:
        return False
    expr = call.args[0].value if len(call.args) == 1 else None
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in _VIEWS:
        expr = expr.func.value
    return isinstance(expr, cst.Call) and source.self_attribute(expr.func) == proj.target


class QKNormRopePattern(Pattern):
    """A rotary-apply call whose q and k each come only from a per-head fused `RMSNorm` child (Qwen3's
    q_norm / k_norm) -> one ``self.qk_norm_rope(q, k, cos, sin, q_norm=..., k_norm=...[, value=v])``.
    Facts: head_size, inplace. Name "value" (the attention's value variable) when the K/V write is proved."""

    name = "qk_norm_rope"

    @classmethod
    def match(cls, traced, ctx: Context) -> list[Match]:
        """Each such call; `Refusal` on a near miss (one shared norm, another norm form or width, not neox)."""
        matches = []
        for call, metas in apply_calls(traced):
            found = fused_norms(call, traced)
            if found is None:
                continue
            require(not isinstance(found, str), found)
            q_norm, k_norm = found
            names = (("fn", call.target.__name__), ("q_norm", q_norm.target), ("k_norm", k_norm.target))
            value = _attention_value(call, traced)
            names += (("value", value),) if value else ()
            facts = (("head_size", int(metas[0].shape[-1])),
                     ("inplace", _fresh_input(q_norm, traced) and _fresh_input(k_norm, traced)))
            matches.append(Match(cls, frozenset({call.name, q_norm.name, k_norm.name}), names, facts))
        return matches

    @classmethod
    def rewrite(cls, match: Match, src, tree: cst.Module) -> cst.Module:
        """Drop both norm calls, call ``self.qk_norm_rope`` with the norms; `Refusal` if a norm result has other uses."""
        fn = match.name("fn")
        apply = unique_call(src, tree, fn)
        require(len(apply.args) >= 4 and all(not a.keyword and not a.star for a in apply.args[:4]),
                f"{fn} does not take q, k, cos, sin positionally")
        info = source.collect(tree)
        edits = {}
        for i, role in enumerate(_ROLES):
            norm = source.unique_self_call(tree, match.name(role), info)
            _check_only_apply_reads(info, norm, apply, i)
            require(len(norm.args) == 1 and not norm.args[0].keyword and not norm.args[0].star,
                    f"self.{match.name(role)} does not take one positional argument")
            edits[id(norm)] = _parenthesized(norm.args[0].value)
        extra = [cst.Arg(cst.parse_expression(f"self.{match.name(r)}"), keyword=cst.Name(r),
                         equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace(""))) for r in _ROLES]
        if "value" in dict(match.names):  # still the attention's value, bound before the rotary call
            require(_value_variable(tree, fn) == match.name("value"), "the attention's value variable changed")
            extra.append(cst.Arg(cst.Name(match.name("value")), keyword=cst.Name("value"), equal=extra[0].equal))
        func = cst.parse_expression(f"self.{NEW_NAME}")
        edits[id(apply)] = lambda c: c.with_changes(func=func, args=[*c.args, *extra])
        return source.replace_many(tree, edits)

    @classmethod
    def validate(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        """Both norms are Llama-form `RMSNorm` of head_size features on this instance; the name is free."""
        free_attribute(module, NEW_NAME)
        for role in _ROLES:
            name = match.name(role)
            reason = norm_refusal(name, getattr(module, name, None), match.fact("head_size"))
            if reason:
                raise Refusal(f"{reason} on this instance")

    @classmethod
    def build(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        """Set ``qk_norm_rope`` (`QKNormRotaryEmb`, in place when the match proved the inputs fresh; writing
        K/V in an engine step when it passes the value and this instance has an int ``layer_idx``, the index
        the engine's attention function reads)."""
        layer = getattr(module, "layer_idx", None) if "value" in dict(match.names) else None
        layer = layer if isinstance(layer, int) and not isinstance(layer, bool) else None
        setattr(module, NEW_NAME, QKNormRotaryEmb(inplace=match.fact("inplace"), layer_idx=layer))
        for name in ("q_norm", "k_norm"):
            note_rewritten_call(getattr(module, match.name(name)), "called by qk_norm_rope on [batch, heads, tokens, "
                                "head_dim] (transformers: [batch, tokens, heads, head_dim]); without hooks, inside its "
                                "kernel")

    @classmethod
    def describe(cls, match: Match) -> str:
        """``q_norm,k_norm + fn -> qk_norm_rope (in place | on a copy[, + K/V cache write])``."""
        mode = "in place" if match.fact("inplace") else "on a copy"
        mode += ", + K/V cache write" if "value" in dict(match.names) else ""
        return f"{match.name('q_norm')},{match.name('k_norm')} + {match.name('fn')} -> {NEW_NAME} ({mode})"


def _attention_value(call: fx.Node, traced) -> str | None:
    """The attention's value variable when the graph shows one attention call as the only reader of this
    rotary call's q and k (its query and key) and of its value, and the source binds that variable before
    the rotary call (`_value_variable`); else None (no K/V write: the attention writes the cache)."""
    outs = nodes.getitem_users(call)
    readers = {u for o in outs.values() for u in o.users}
    attn = readers.pop() if len(readers) == 1 and all(len(o.users) == 1 for o in outs.values()) else None
    if attn is None or attn.op != "call_function" or attn.target is not tracer.attention or len(attn.args) < 4:
        return None
    value = attn.args[3]
    if attn.args[1:3] != (outs[0], outs[1]) or not isinstance(value, fx.Node) or len(value.users) != 1:
        return None
    try:
        return _value_variable(source.ForwardSource.recover(type(traced.module)).tree, call.target.__name__)
    except source.SourceError:
        return None


def _value_variable(tree: cst.Module, fn: str) -> str | None:
    """V for ``q, k = fn(...)`` followed in its block by the one call ``attention(self, q, k, V, ...)``, V
    bound by a plain statement of that block before the rotary call (so defined there); else None."""
    calls, info = calls_of(tree, fn), source.collect(tree)
    if len(calls) != 1:
        return None
    (stmt, block), (line, _) = _small_statement(info, calls[0]), source.enclosing_statement(info, calls[0])
    target = stmt.targets[0].target if isinstance(stmt, cst.Assign) and len(stmt.targets) == 1 else None
    if not isinstance(target, cst.Tuple) or len(target.elements) != 2:
        return None
    q, k = (e.value.value if isinstance(e.value, cst.Name) else None for e in target.elements)
    body = source.block_statements(block)
    i = next(j for j, s in enumerate(body) if s is line)
    before, after = body[:i], body[i + 1:]
    found = [c for s in after for c in _calls(s) if _positional_names(c)[:3] == ["self", q, k]]
    value = _positional_names(found[0])[3] if len(found) == 1 and len(_positional_names(found[0])) > 3 else None
    bound = any(value in source.assigned_names(s) for s in before if isinstance(s, cst.SimpleStatementLine))
    return value if q and k and value and bound and value not in (q, k, "self") else None


def _calls(node: cst.CSTNode) -> list[cst.Call]:
    found: list[cst.Call] = []

    class V(cst.CSTVisitor):
        def visit_Call(self, call):
            found.append(call)

    node.visit(V())
    return found


def _positional_names(call: cst.Call) -> list[str | None]:
    """The leading positional arguments of `call` that are bare names (None for any other expression)."""
    args = [a for a in call.args if not a.keyword and not a.star]
    return [a.value.value if isinstance(a.value, cst.Name) else None for a in args]


def _parenthesized(expr: cst.BaseExpression) -> cst.BaseExpression:
    """`expr` safe to put where the call was (``.transpose`` may follow): atoms as is, else in parentheses."""
    if isinstance(expr, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)) or expr.lpar:
        return expr
    return expr.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])


def _small_statement(info, node: cst.CSTNode) -> tuple[cst.BaseSmallStatement, cst.CSTNode]:
    """The small statement holding `node` (a line may hold several: QKV prepends one) and its block."""
    line, block = source.enclosing_statement(info, node)
    small = node
    while source.parent(info, small) is not line:
        small = source.parent(info, small)
    return small, block


def _check_only_apply_reads(info, norm: cst.Call, apply: cst.Call, index: int) -> None:
    """Refuse unless the norm's result reaches nothing but the apply call's argument `index`: either the
    norm sits inside that argument, or ``N = ...norm(...)...`` binds N, no statement between mentions N,
    and the apply statement rebinds N (so dropping the norm there changes no other reader)."""
    arg = apply.args[index]
    node = norm
    while node is not None and node is not apply:
        if node is arg:
            return
        node = source.parent(info, node)
    stmt, block = _small_statement(info, norm)
    target = stmt.targets[0].target if isinstance(stmt, cst.Assign) and len(stmt.targets) == 1 else None
    require(isinstance(target, cst.Name) and isinstance(arg.value, cst.Name) and arg.value.value == target.value,
            "a q/k norm's result is not the variable passed to the rotary call")
    name = target.value
    apply_stmt, apply_block = _small_statement(info, apply)
    require(apply_block is block, "the norm and the rotary call are in different blocks")
    smalls = [s for ln in source.block_statements(block)
              for s in (ln.body if isinstance(ln, cst.SimpleStatementLine) else [ln])]
    positions = [i for i, s in enumerate(smalls) if s is stmt or s is apply_stmt]
    require(len(positions) == 2 and smalls[positions[0]] is stmt, "the norm does not precede the rotary call")
    between = smalls[positions[0] + 1: positions[1]]
    require(not any(name in source.collect(s).names for s in between), f"{name!r} is used between the norm and rotary")
    require(name in source.assigned_names(apply_stmt), f"the rotary call's statement does not rebind {name!r}")
