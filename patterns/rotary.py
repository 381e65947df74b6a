"""Rotary: the module turning position ids into (cos, sin) -> a `RotaryEmbedding` from `get_rope`;
``apply_rotary_pos_emb(q, k, cos, sin)`` in attention -> one op rotating q and k.

`RotaryPattern` matches a module whose forward returns ``(cos(e), sin(e))`` of one tensor (up
to a constant scale and casts) and replaces it with `RotaryCosSin`, which reads cos/sin from a
`RotaryEmbedding` built by `fxrewrite.layers.rotary.get_rope` from the config's
``rope_parameters`` (every rope type, YaRN included). Each instance is probed: the new module
must reproduce the old one's cos/sin at sample positions, or the instance is left alone.
`RotaryApplyPattern` matches a call of a plain function taking (q, k, cos, sin) whose two
outputs equal `apply_rotary_qk` bit for bit on random inputs of the traced shapes, and calls
the fused op instead, except where q and k are per-head RMSNorms: `qk_norm_rope` fuses those calls.
"""

from __future__ import annotations

import inspect
import operator

import libcst as cst
import torch
from torch import nn

from fxrewrite import nodes
from fxrewrite.tensor_state import preserved_state
from fxrewrite.kernels import use_triton
from fxrewrite.kernels.rotary import rotary_embedding_triton
from fxrewrite.layers.rotary import get_rope
from fxrewrite.patterns.base import Context, Match, Pattern, Refusal, free_attribute, require

NEW_APPLY = "apply_rotary_emb"
_PROBE_POSITIONS = (0, 1, 2, 3, 7, 31, 100)


def apply_rotary_qk(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Rotate q and k (neox "rotate half" form, partial rotary when cos is narrower than a head).

    q [B, Hq, S, D], k [B, Hk, S, D], cos/sin [B, S, rotary_dim] (unsqueezed at `unsqueeze_dim`).
    Formula: transformers `apply_rotary_pos_emb`: x * cos + rotate_half(x) * sin on the first
    rotary_dim channels; the rest passes through.
    """
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]

    def rotate(x):
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        half = rotary_dim // 2
        out = (x_rot * cos) + (torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1) * sin)
        return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)

    return rotate(q), rotate(k)


class ApplyRotaryEmb(nn.Module):
    """`apply_rotary_qk` as a module (no parameters), so the rewritten forward can call it.

    Inference on a GPU (no autograd, one batch row: the serving engine's flattened tokens) runs the
    Triton rotary kernel on copies of q and k: 5 kernels instead of the ~12 elementwise ones of the
    torch form, which computes in the input dtype where the kernel computes in float32.
    """

    def forward(self, q, k, cos, sin, unsqueeze_dim: int = 1):
        if _kernel_applies(q, k, cos, unsqueeze_dim):
            return _rotary_kernel_qk(q, k, cos, sin)
        return apply_rotary_qk(q, k, cos, sin, unsqueeze_dim)


def _kernel_applies(q, k, cos, unsqueeze_dim: int) -> bool:
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or cos.requires_grad)
    return (not grad and use_triton(q) and unsqueeze_dim == 1 and q.dim() == 4 and k.dim() == 4
            and q.shape[0] == 1 and cos.dim() == 3 and cos.shape[:2] == (1, q.shape[2]) and q.stride(-1) == 1
            and k.stride(-1) == 1 and cos.shape[-1] % 2 == 0 and cos.shape[-1] <= q.shape[-1])


def _rotary_kernel_qk(q, k, cos, sin):
    """q [1, Hq, S, D], k [1, Hk, S, D], cos/sin [1, S, rotary_dim] (neox: each half repeated) -> new q, k."""
    half = cos.shape[-1] // 2
    cache = torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1)  # row s = position s's cos | sin
    positions = torch.arange(cache.shape[0], device=q.device)
    q_out, k_out = q.clone(), k.clone()  # the kernel rotates in place; the callers' q and k stay as they were
    rotary_embedding_triton(positions, q_out[0].transpose(0, 1), k_out[0].transpose(0, 1), q.shape[-1], cache, True)
    return q_out, k_out


class RotaryCosSin(nn.Module):
    """Drop-in for an HF rotary module: ``forward(x, position_ids) -> (cos, sin)`` in x's dtype.

    cos/sin [*position_ids.shape, rotary_dim] come from ``rope.get_cos_sin`` (cached table).
    """

    def __init__(self, rope: nn.Module, arg_names: tuple[str, str]) -> None:
        super().__init__()
        self.rope = rope
        self.arg_names = arg_names

    def forward(self, *args, **kwargs):
        bound = dict(zip(self.arg_names, args), **kwargs)
        x, positions = bound[self.arg_names[0]], bound[self.arg_names[1]]
        return self.rope.get_cos_sin(positions, dtype=x.dtype)


LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")


def replace_length_dependent_rotary(model: nn.Module, config) -> list[str]:
    """Swap every transformers rotary module of a length-dependent type still in `model` for a checked
    `RotaryCosSin`, which reads per-token lengths (fxrewrite.layers.rope_context) where transformers'
    picks one length for the whole call. Returns the replaced modules' names.

    For serving without fusion: the engine flattens a step's sequences into one row, so transformers'
    module would let a sequence's neighbours choose its frequencies. Raises ValueError naming the
    module when no RotaryEmbedding reproduces it.
    """
    replaced = []
    for name, module in list(model.named_modules()):
        if getattr(module, "rope_type", None) not in LENGTH_DEPENDENT_ROPE_TYPES or not name:
            continue
        if not hasattr(module, "original_inv_freq"):  # not transformers' rotary module
            continue
        params = [p for p in inspect.signature(type(module).forward).parameters][1:3]
        try:
            new = RotaryPattern._build_checked(module, Context(model, config), tuple(params))
        except Refusal as e:
            raise ValueError(f"{name} ({type(module).__name__}): cannot serve its {module.rope_type} rope "
                             f"per sequence: {e}") from None
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
        replaced.append(name)
    return replaced


def _cos_sin_source(node):
    """The tensor e when `node` is cos(e)/sin(e) times constants and casts, with the op name."""
    node = nodes.peel(node)
    while nodes.is_op(node, operator.mul) and any(isinstance(a, (int, float)) for a in node.args):
        node = nodes.peel(next(a for a in node.args if not isinstance(a, (int, float))))
    for op in ("cos", "sin"):
        if nodes.is_op(node, op, getattr(torch, op)):
            return op, node.args[0]
    return None, None


def _rope_candidates(config) -> list[dict]:
    params = getattr(config, "rope_parameters", None) or {}
    found = [params] if "rope_type" in params else [v for v in params.values() if isinstance(v, dict)]
    factor = getattr(config, "partial_rotary_factor", None)
    return [dict(p, partial_rotary_factor=p.get("partial_rotary_factor", factor)) if factor else dict(p) for p in found]


class RotaryPattern(Pattern):
    """See module docstring (the cos/sin module)."""

    name = "rotary"
    scope = "module"

    @classmethod
    def match(cls, traced, ctx: Context) -> list[Match]:
        out = nodes.output_value(traced.graph)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            return []
        (op0, e0), (op1, e1) = _cos_sin_source(out[0]), _cos_sin_source(out[1])
        if (op0, op1) != ("cos", "sin") or e0 is not e1:
            return []
        params = [p for p in inspect.signature(type(traced.module).forward).parameters][1:]
        require(len(params) == 2, f"rotary forward takes {params}, expected (x, position_ids)")
        claimed = frozenset(n.name for n in traced.graph.nodes if n.op != "output")
        return [Match(cls, claimed, (("x", params[0]), ("position_ids", params[1])))]

    @classmethod
    def _build_checked(cls, module: nn.Module, ctx: Context, names: tuple[str, str]) -> nn.Module:
        buffers = list(module.buffers())
        require(bool(buffers) and not buffers[0].is_meta, "rotary buffers are on meta; cannot verify cos/sin")
        config = ctx.config
        head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        max_pos = config.max_position_embeddings
        device = buffers[0].device
        positions = torch.tensor([[p for p in _PROBE_POSITIONS if p < max_pos] + [max_pos - 1]], device=device)
        x = torch.zeros(1, dtype=torch.float32, device=device)
        with torch.no_grad(), preserved_state(module):  # transformers' longrope/dynamic update writes state
            ref_cos, ref_sin = module(x, positions)
        reasons = []
        for params, neox in [(p, n) for p in _rope_candidates(config) for n in (True, False)]:
            try:
                new = RotaryCosSin(get_rope(head_size, max_pos, params, neox, torch.float32, device), names)
                cos, sin = new(x, positions)
            except (ValueError, KeyError, TypeError, RuntimeError) as e:
                reasons.append(str(e))
                continue
            if cos.shape == ref_cos.shape and torch.allclose(cos, ref_cos, rtol=1e-5, atol=1e-5) and \
                    torch.allclose(sin, ref_sin, rtol=1e-5, atol=1e-5):
                return new
            reasons.append(f"cos/sin of {params.get('rope_type')} ({'neox' if neox else 'gpt-j'}) differ")
        raise_reason = "; ".join(reasons) or "config has no rope_parameters"
        require(False, f"no RotaryEmbedding reproduces this module ({raise_reason})")

    @classmethod
    def validate(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        require(ctx.config is not None, "no model config to read rope_parameters from")
        module.__dict__["_fxrewrite_rope"] = cls._build_checked(module, ctx, (match.name("x"), match.name("position_ids")))

    @classmethod
    def build(cls, match: Match, module: nn.Module, ctx: Context) -> nn.Module:
        return module.__dict__.pop("_fxrewrite_rope")

    @classmethod
    def describe(cls, match: Match) -> str:
        return "cos/sin -> RotaryEmbedding (get_rope)"


class RotaryApplyPattern(Pattern):
    """See module docstring (the apply call)."""

    name = "rotary_apply"

    @classmethod
    def match(cls, traced, ctx: Context) -> list[Match]:
        from fxrewrite.patterns.qk_norm_rope import fused_norms  # that module builds on this one

        matches = []
        for n, metas in apply_calls(traced):
            if isinstance(fused_norms(n, traced), tuple):  # q/k per-head norms: qk_norm_rope fuses the call
                continue
            require(_same_outputs(n, metas), f"{n.target.__name__} does not compute neox rotary on q and k")
            matches.append(Match(cls, frozenset({n.name}), (("fn", n.target.__name__),)))
        return matches

    @classmethod
    def rewrite(cls, match: Match, src, tree: cst.Module) -> cst.Module:
        name = match.name("fn")
        require(callable(src.globals.get(name)), f"{name} is not a global function of the module")
        calls = _calls_of(tree, name)
        require(len(calls) == 1, f"{name}(...) appears {len(calls)} times in forward, expected exactly once")
        return tree.deep_replace(calls[0].func, cst.parse_expression(f"self.{NEW_APPLY}"))

    @classmethod
    def validate(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        free_attribute(module, NEW_APPLY)

    @classmethod
    def build(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        setattr(module, NEW_APPLY, ApplyRotaryEmb())

    @classmethod
    def describe(cls, match: Match) -> str:
        return f"{match.name('fn')} -> {NEW_APPLY}"


def apply_calls(traced):
    """(node, metas of q, k, cos, sin) for each leaf function call shaped like a rotary apply:
    (q [B, H, S, D], k, cos [B, S, d], sin[, unsqueeze_dim]) -> exactly its two outputs used."""
    for n in traced.graph.nodes:
        if n.op != "call_function" or not callable(n.target) or not nodes.is_leaf_call(n):
            continue
        metas = [nodes.meta(a) for a in n.args[:4]]
        if len(n.args) < 4 or any(m is None for m in metas) or set(n.kwargs) - {"unsqueeze_dim"}:
            continue
        if [m.dim() for m in metas] != [4, 4, 3, 3] or len(n.args) > 5:
            continue
        if set(nodes.getitem_users(n)) == {0, 1} and len(n.users) == 2:
            yield n, metas


def _same_outputs(node, metas) -> bool:
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(m.shape, generator=gen, dtype=torch.float32) for m in metas] + list(node.args[4:])
    try:
        with torch.no_grad():
            want = node.target(*args, **node.kwargs)
        got = apply_rotary_qk(*args, **node.kwargs)
    except Exception:  # noqa: BLE001 - not a rotary function of this shape
        return False
    return len(want) == 2 and all(isinstance(w, torch.Tensor) and w.shape == g.shape and torch.equal(w, g)
                                  for w, g in zip(want, got))


def _calls_of(tree: cst.Module, name: str) -> list[cst.Call]:
    found: list[cst.Call] = []

    class V(cst.CSTVisitor):
        def visit_Call(self, node):
            if isinstance(node.func, cst.Name) and node.func.value == name:
                found.append(node)

    tree.visit(V())
    return found
