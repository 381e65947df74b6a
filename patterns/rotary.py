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
from fxrewrite.kernels.rotary import rotary_embedding_triton
from fxrewrite.kernels.batch_invariant import is_batch_invariant
from fxrewrite.kernels.rotary_backward import rotary_apply_train
from fxrewrite.layers.rotary import get_rope
from fxrewrite.patterns.base import Context, Match, Pattern, Refusal, free_attribute, require
from fxrewrite.patterns.rotary_calls import (apply_calls, apply_rotary_qk, fused_norms, kernel_applies, packed_cos_sin,
                                             remember_cos_sin, same_outputs, unique_call)
from fxrewrite.tensor_state import preserved_state

NEW_APPLY = "apply_rotary_emb"
_PROBE_POSITIONS = (0, 1, 2, 3, 7, 31, 100)


class ApplyRotaryEmb(nn.Module):
    """`apply_rotary_qk` as a module (no parameters), so the rewritten forward can call it.

    Inference on a GPU (no autograd, one batch row: the serving engine's flattened tokens) runs the
    Triton rotary kernel on copies of q and k: 5 kernels instead of the ~12 elementwise ones of the
    torch form, which computes in the input dtype where the kernel computes in float32.
    """

    def forward(self, q, k, cos, sin, unsqueeze_dim: int = 1):
        """q [B, Hq, S, D], k [B, Hk, S, D], cos/sin [B, S, rotary_dim] -> rotated (q, k), same shapes and dtype."""
        if kernel_applies(q, k, cos, unsqueeze_dim) and not is_batch_invariant():
            return _rotary_kernel_qk(q, k, cos, sin)
        # training: Triton forward + backward (autograd through torch off the GPU); batch-invariant: the
        # engine rotates exactly as the trainer does
        if _needs_grad(q, k) or is_batch_invariant():
            return rotary_apply_train(q, k, cos, sin, unsqueeze_dim)
        return apply_rotary_qk(q, k, cos, sin, unsqueeze_dim)


def _needs_grad(q, k) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)


def _rotary_kernel_qk(q, k, cos, sin):
    """q [1, Hq, S, D], k [1, Hk, S, D], cos/sin [1, S, rotary_dim] (neox: each half repeated) -> new q, k; the
    callers' q and k stay as they were."""
    positions, cache, _ = packed_cos_sin(cos, sin)
    if cos.shape[-1] == q.shape[-1]:  # the whole head rotates: into new tensors (laid out as clone lays them out)
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        rotary_embedding_triton(positions, _tokens(q), _tokens(k), q.shape[-1], cache, True,
                                query_out=_tokens(q_out), key_out=_tokens(k_out))
    else:  # a partial rotary: the kernel rotates the first features of copies in place
        q_out, k_out = q.clone(), k.clone()
        rotary_embedding_triton(positions, _tokens(q_out), _tokens(k_out), q.shape[-1], cache, True)
    return q_out, k_out


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """[1, H, S, D] -> the [S, H, D] view the rotary kernel takes."""
    return x[0].transpose(0, 1)


class RotaryCosSin(nn.Module):
    """Drop-in for an HF rotary module: ``forward(x, position_ids) -> (cos, sin)`` in x's dtype.

    cos/sin [*position_ids.shape, rotary_dim] come from ``rope.get_cos_sin`` (cached table). At inference
    with one batch row they are also remembered as rows of ``rope.cos_sin_table`` (`remember_cos_sin`), so
    the fused rotary ops read that table at the positions instead of packing cos / sin again every step.
    """

    def __init__(self, rope: nn.Module, arg_names: tuple[str, str]) -> None:
        super().__init__()
        self.rope = rope
        self.arg_names = arg_names
        self.kept_attributes: dict = {}

    def keep_attributes(self, original: nn.Module) -> None:
        """Answer reads of `original`'s plain public attributes (config, rope_type, attention_scaling...: not
        tensors, not modules), which a parent may read besides calling it (GraniteSWA reads
        ``rotary_emb.config.rope_parameters``)."""
        self.kept_attributes = {k: v for k, v in vars(original).items() if not k.startswith("_") and k != "training"
                                and not isinstance(v, (torch.Tensor, nn.Module))}

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            kept = self.__dict__.get("kept_attributes", {})
            if name in kept:
                return kept[name]
            if name in ("inv_freq", "original_inv_freq"):  # transformers' buffers, read by code that inspects them
                return super().__getattr__("rope").inv_freq
            raise

    def forward(self, *args, **kwargs):
        """(x, position_ids [B, S]), by position or keyword -> (cos, sin) [B, S, rotary_dim] in x's dtype."""
        bound = dict(zip(self.arg_names, args), **kwargs)
        x, positions = bound[self.arg_names[0]], bound[self.arg_names[1]]
        rescale = self._rescale()
        if rescale is not None:  # attention_scaling set since optimize: transformers multiplies by it in float32
            cos, sin = self.rope.get_cos_sin(positions, dtype=torch.float32)
            return (cos * rescale).to(x.dtype), (sin * rescale).to(x.dtype)
        cos, sin = self.rope.get_cos_sin(positions, dtype=x.dtype)
        table = self.rope.cos_sin_table(x.dtype)  # cos / sin are its rows `positions` when it exists
        if table is not None and self.rope.is_neox_style and _one_row(positions, table.device):
            half = self.rope.rotary_dim // 2
            remember_cos_sin(cos, sin, positions[0], table[:, half: 3 * half])
        return cos, sin

    def _rescale(self) -> float | None:
        """new / proven ``attention_scaling`` once the user set another on this module after `optimize` (transformers'
        forward multiplies cos and sin by the attribute at each call; the cached table holds the proven factor: a
        fresh user's find, a new value was silently ignored), else None."""
        kept = self.kept_attributes.get("attention_scaling")
        now = self.__dict__.get("attention_scaling", kept)
        if now is kept or not isinstance(kept, (int, float)) or not kept or now == kept:
            return None
        return now / kept


def _one_row(positions: torch.Tensor, device: torch.device) -> bool:
    """positions [1, S], unit stride, on `device`: what the rotary kernels read directly."""
    return positions.dim() == 2 and positions.shape[0] == 1 and positions.stride(-1) == 1 and \
        positions.device == device


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
        if isinstance(module, RotaryCosSin) or not hasattr(module, "original_inv_freq"):  # ours already, or not
            continue  # transformers' rotary module (ours answers original_inv_freq too, for code reading it)
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
    """A module returning ``(cos(e), sin(e))`` of one tensor -> `RotaryCosSin` over `get_rope` (RoFormer, Su et
    al. 2021; the rope types of transformers' ROPE_INIT_FUNCTIONS)."""

    name = "rotary"
    scope = "module"

    @classmethod
    def match(cls, traced, ctx: Context) -> list[Match]:
        """The whole forward when it returns (cos(e), sin(e)) (scales, casts aside); `Refusal` unless it takes 2 args."""
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
                new.rope.__dict__.pop("_tables", None)  # a probe keeps no inference table (built at first use)
            except (ValueError, KeyError, TypeError, RuntimeError) as e:
                reasons.append(str(e))
                continue
            if cos.shape == ref_cos.shape and torch.allclose(cos, ref_cos, rtol=1e-5, atol=1e-5) and \
                    torch.allclose(sin, ref_sin, rtol=1e-5, atol=1e-5):
                new.keep_attributes(module)
                return new
            reasons.append(f"cos/sin of {params.get('rope_type')} ({'neox' if neox else 'gpt-j'}) differ")
        raise_reason = "; ".join(reasons) or "config has no rope_parameters"
        require(False, f"no RotaryEmbedding reproduces this module ({raise_reason})")

    @classmethod
    def validate(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        """Build the replacement; it must give this instance's cos/sin (1e-5) at probe positions, else `Refusal`."""
        require(ctx.config is not None, "no model config to read rope_parameters from")
        module.__dict__["_fxrewrite_rope"] = cls._build_checked(module, ctx, (match.name("x"), match.name("position_ids")))

    @classmethod
    def build(cls, match: Match, module: nn.Module, ctx: Context) -> nn.Module:
        """The `RotaryCosSin` that `validate` proved."""
        return module.__dict__.pop("_fxrewrite_rope")

    @classmethod
    def describe(cls, match: Match) -> str:
        """``cos/sin -> RotaryEmbedding (get_rope)``."""
        return "cos/sin -> RotaryEmbedding (get_rope)"


class RotaryApplyPattern(Pattern):
    """A module-global function call (q, k, cos, sin) equal bit for bit to transformers' ``apply_rotary_pos_emb``
    -> ``self.apply_rotary_emb(...)`` (`ApplyRotaryEmb`), except the calls `QKNormRopePattern` fuses."""

    name = "rotary_apply"

    @classmethod
    def match(cls, traced, ctx: Context) -> list[Match]:
        """Each rotary-apply call not fed by per-head norms; `Refusal` when its function is not neox rotary."""
        matches = []
        for n, metas in apply_calls(traced):
            if isinstance(fused_norms(n, traced), tuple):  # q/k per-head norms: qk_norm_rope fuses the call
                continue
            require(same_outputs(n, metas), f"{n.target.__name__} does not compute neox rotary on q and k")
            matches.append(Match(cls, frozenset({n.name}), (("fn", n.target.__name__),)))
        return matches

    @classmethod
    def rewrite(cls, match: Match, src, tree: cst.Module) -> cst.Module:
        """Call ``self.apply_rotary_emb`` instead of the function; `Refusal` unless it is called exactly once."""
        call = unique_call(src, tree, match.name("fn"))
        return tree.deep_replace(call.func, cst.parse_expression(f"self.{NEW_APPLY}"))

    @classmethod
    def validate(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        """``apply_rotary_emb`` is free on this instance."""
        free_attribute(module, NEW_APPLY)

    @classmethod
    def build(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        """Set ``apply_rotary_emb`` (`ApplyRotaryEmb`, no parameters)."""
        setattr(module, NEW_APPLY, ApplyRotaryEmb())

    @classmethod
    def describe(cls, match: Match) -> str:
        """``fn -> apply_rotary_emb``."""
        return f"{match.name('fn')} -> {NEW_APPLY}"
