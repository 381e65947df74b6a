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
in place when the norms' inputs are provably fresh projection outputs, else on one copy.
"""

from __future__ import annotations

import libcst as cst
import torch
import torch.fx as fx
from torch import nn

from fxrewrite import nodes, source
from fxrewrite.kernels.batch_invariant import is_batch_invariant
from fxrewrite.kernels import compiled_training_kernels, use_triton
from fxrewrite.kernels.qk_norm_rope import qk_norm_rope_triton
from fxrewrite.kernels.qk_norm_rope_backward import fits
from fxrewrite.kernels.qk_norm_rope_op import qk_norm_rope_fused
from fxrewrite.kernels.rotary_backward import rotary_apply_train
from fxrewrite.layers.layernorm import RMSNorm
from fxrewrite.patterns.base import Context, Match, Pattern, Refusal, free_attribute, require
from fxrewrite.patterns.rotary_calls import (apply_calls, apply_rotary_qk, fused_norms, kernel_applies, norm_refusal,
                                             packed_cos_sin, unique_call)

NEW_NAME = "qk_norm_rope"
_ROLES = ("q_norm", "k_norm")
_VIEWS = frozenset({"view", "reshape"})


class QKNormRotaryEmb(nn.Module):
    """``forward(q, k, cos, sin, unsqueeze_dim=1, *, q_norm, k_norm) -> (q, k)``, rotated after the norms.

    q [B, Hq, S, D], k [B, Hk, S, D] (un-normalised), cos/sin [B, S, rotary_dim] (neox: halves repeated);
    q_norm / k_norm are the attention's own `RMSNorm` children (weight [D]). The torch form (CPU, batch > 1)
    is ``apply_rotary_qk(q_norm(q), k_norm(k), cos, sin)``, transformers' computation op for op; while
    autograd records on CUDA, one Triton kernel each way (`fxrewrite.kernels.qk_norm_rope_backward`; else the
    norms' and the rotary's training kernels). Inference on a GPU with one batch row (the engine's flattened tokens) runs the Triton
    kernel `qk_norm_rope` (float32 math, Llama's roundings): on q and k themselves when ``inplace`` (set only
    when the pattern proved nothing else reads them), else on copies.
    """

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace

    def forward(self, q, k, cos, sin, unsqueeze_dim: int = 1, *, q_norm: RMSNorm, k_norm: RMSNorm):
        """q [B, Hq, S, D], k [B, Hk, S, D], cos/sin [B, S, rotary_dim] -> (q, k) normalised, rotated; q's dtype."""
        invariant = is_batch_invariant()  # the engine normalises and rotates as the trainer does
        if self._kernel_applies(q, k, cos, unsqueeze_dim, q_norm, k_norm) and not invariant:
            return self._kernel(q, k, cos, sin, q_norm, k_norm)
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, q_norm.weight, k_norm.weight))
        kernels = use_triton(q) or compiled_training_kernels(q)  # eager, or custom ops under torch.compile
        if training and not invariant and kernels and self._llama_form(q_norm, k_norm) and fits(
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

    def _kernel(self, q, k, cos, sin, q_norm, k_norm):
        positions, cache = packed_cos_sin(cos, sin)
        if not self.inplace:
            q, k = q.clone(), k.clone()
        qk_norm_rope_triton(positions, q[0].transpose(0, 1), k[0].transpose(0, 1), q_norm.weight, k_norm.weight,
                            q_norm.variance_epsilon, q.shape[-1], cache, True)
        return q, k

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
    q_norm / k_norm) -> one ``self.qk_norm_rope(q, k, cos, sin, q_norm=..., k_norm=...)``. Facts: head_size, inplace."""

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
        """Set ``qk_norm_rope`` (`QKNormRotaryEmb`, in place when the match proved the inputs fresh)."""
        setattr(module, NEW_NAME, QKNormRotaryEmb(inplace=match.fact("inplace")))

    @classmethod
    def describe(cls, match: Match) -> str:
        """``q_norm,k_norm + fn -> qk_norm_rope (in place | on a copy)``."""
        mode = "in place" if match.fact("inplace") else "on a copy"
        return f"{match.name('q_norm')},{match.name('k_norm')} + {match.name('fn')} -> {NEW_NAME} ({mode})"


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
