"""The rotary-apply call, shared by `rotary` (the plain call) and `qk_norm_rope` (the call whose q and k
are per-head RMSNorms): the torch reference, the graph matcher and the probe that proves a call neox.

Formula: transformers ``apply_rotary_pos_emb`` (``x * cos + rotate_half(x) * sin``, Su et al. 2021,
RoFormer's rotary position embedding in GPT-NeoX's "rotate half" layout).
"""

from __future__ import annotations

import weakref

import libcst as cst
import torch
import torch.fx as fx

from fxrewrite import nodes
from fxrewrite.kernels import use_triton
from fxrewrite.layers.layernorm import RMSNorm
from fxrewrite.patterns.base import require


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


def kernel_applies(q, k, cos, unsqueeze_dim: int) -> bool:
    """Whether the Triton rotary kernels can take this call: no autograd, a GPU, one batch row, q and k
    [1, H, S, D] with unit last stride, cos [1, S, rotary_dim] with an even rotary_dim <= D."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or cos.requires_grad)
    return (not grad and use_triton(q) and unsqueeze_dim == 1 and q.dim() == 4 and k.dim() == 4
            and q.shape[0] == 1 and cos.dim() == 3 and cos.shape[:2] == (1, q.shape[2]) and q.stride(-1) == 1
            and k.stride(-1) == 1 and cos.shape[-1] % 2 == 0 and cos.shape[-1] <= q.shape[-1])


_packed: tuple = ()  # (weakref cos, weakref sin, cos._version, sin._version, positions, cache) of the last call


def packed_cos_sin(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """cos/sin [1, S, rotary_dim] (neox: each half repeated) -> (positions [S] int, cache [N, rotary_dim], settled),
    cache row positions[s] = token s's cos half | sin half, the rotary kernels' table: the rotary module's
    own table when it noted cos/sin (`remember_cos_sin`), else cos / sin packed (N = S, positions 0..S-1).
    settled: nothing was launched to make positions or cache in this call, so the kernel launched just before
    the caller's did not write them (what `fxrewrite.kernels.pdl.early_loads` asks of a kernel's inputs).

    Every decoder layer of one forward gets the same cos/sin tensors, so the table is built once per forward
    and reused while those tensors live unchanged (two launches per layer fewer in a decode step); not under
    torch.compile, which traces the build into each layer's graph instead.
    """
    global _packed
    versions = (_version(cos), _version(sin))
    if _packed and _packed[0]() is cos and _packed[1]() is sin and _packed[2:4] == versions:
        return _packed[4], _packed[5], True
    half = cos.shape[-1] // 2
    cache = torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1)
    positions = torch.arange(cache.shape[0], device=cos.device)
    if not torch.compiler.is_compiling():  # the table dies with cos (it may live in a CUDA graph's pool)
        _packed = (weakref.ref(cos, _forget), weakref.ref(sin), *versions, positions, cache)
    return positions, cache, False


def remember_cos_sin(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> None:
    """Note that cos/sin [1, S, rotary_dim] (neox) are rows `positions` [S] of the rotary kernels' `table`
    [max_position, rotary_dim] (cos half | sin half, cos's dtype), as a rotary module computed them: while
    they live unchanged, `packed_cos_sin` returns (positions, table, True) and builds nothing (the native models'
    launches: the kernels read the table at the positions). The caller has launched the gather of cos / sin from
    `table` at `positions` after whatever wrote them, so neither was written by the kernel launched last."""
    global _packed
    if not torch.compiler.is_compiling():
        _packed = (weakref.ref(cos, _forget), weakref.ref(sin), _version(cos), _version(sin), positions, table)


def _version(t: torch.Tensor) -> int | None:
    # inference tensors (the engine runs under torch.inference_mode) keep no version counter; the rotary
    # modules return fresh cos / sin each forward and nothing rewrites them in place
    return None if t.is_inference() else t._version


def _forget(dead: weakref.ref) -> None:
    global _packed
    if _packed and _packed[0] is dead:
        _packed = ()


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


def same_outputs(node, metas) -> bool:
    """Whether the called function equals `apply_rotary_qk` bit for bit on seeded random float32 inputs
    of the traced shapes (`metas`); a function that raises on them is not a rotary apply."""
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


def calls_of(tree: cst.Module, name: str) -> list[cst.Call]:
    """Every call of the bare name `name` in `tree`, in source order."""
    found: list[cst.Call] = []

    class V(cst.CSTVisitor):
        def visit_Call(self, node):
            if isinstance(node.func, cst.Name) and node.func.value == name:
                found.append(node)

    tree.visit(V())
    return found


def unique_call(src, tree: cst.Module, name: str) -> cst.Call:
    """The one call of the module-global function `name` in forward's source; `Refusal` when `name` is not
    a global function of the module or is called other than exactly once."""
    require(callable(src.globals.get(name)), f"{name} is not a global function of the module")
    calls = calls_of(tree, name)
    require(len(calls) == 1, f"{name}(...) appears {len(calls)} times in forward, expected exactly once")
    return calls[0]


def _norm_feeding(arg) -> fx.Node | None:
    """The child-module call whose output, only, becomes `arg` (directly or transposed, last dim kept)."""
    if nodes.is_op(arg, "transpose", torch.transpose):
        val, dims = nodes.meta(arg), arg.args[1:]
        if val is None or arg.kwargs or len(dims) != 2 or not all(isinstance(d, int) for d in dims) \
                or len(arg.users) != 1 or any(d % val.dim() == val.dim() - 1 for d in dims):
            return None
        arg = arg.args[0]
    ok = isinstance(arg, fx.Node) and arg.op == "call_module" and len(arg.args) == 1 and not arg.kwargs
    return arg if ok and len(arg.users) == 1 and "." not in arg.target else None


def norm_refusal(name: str, norm, head: int) -> str | None:
    """Why `norm` cannot be fused as a per-head Llama RMSNorm of `head` features (None: it can)."""
    if not isinstance(norm, RMSNorm):
        return f"{name} is {type(norm).__name__}, not a fused RMSNorm (rms_norm did not prove it)"
    if norm.offset or not norm.upcast:
        return f"{name} is not the Llama form (offset {norm.offset:g}, upcast {norm.upcast}) the kernel computes"
    if tuple(norm.weight.shape) != (head,):
        return f"{name} weight has {norm.weight.numel()} elements, expected head_dim {head}"
    return None


def fused_norms(call: fx.Node, traced) -> tuple[fx.Node, fx.Node] | str | None:
    """For a rotary-apply candidate `call`: the (q_norm, k_norm) nodes `qk_norm_rope` fuses with it, a
    near-miss reason, or None when q and k do not come from child modules at all."""
    norms = [_norm_feeding(a) for a in call.args[:2]]
    if None in norms:
        return None
    if norms[0].target == norms[1].target:
        return f"q and k share one norm module {norms[0].target!r}"
    head = int(nodes.meta(call.args[0]).shape[-1])
    for n in norms:
        reason = norm_refusal(n.target, traced.module.get_submodule(n.target), head)
        if reason:
            return reason
    if not same_outputs(call, [nodes.meta(a) for a in call.args[:4]]):
        return f"{call.target.__name__} does not compute neox rotary on q and k"
    return norms[0], norms[1]
