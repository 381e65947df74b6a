"""Sparse mixture-of-experts block -> `FusedMoE` (routing, grouped-GEMM experts, shared expert).

Found by dataflow in the block's graph (scope "module": the whole block is replaced):
- an experts call ``experts(x, ids, weights)`` on a module whose only parameters are two 3-D
  tensors shaped [E, 2I, H] and [E, H, I] (transformers 5's fused experts modules);
- ``ids`` and ``weights`` are two outputs of one router call on the same x; the router's own
  graph must be ``linear(x, weight) -> softmax | sigmoid (last dim) -> topk(k) ->`` values
  (optionally divided by their sum: ``norm_topk_prob``) and indices, or ``linear -> topk(k) ->
  softmax`` of the values (Granite-MoE; the same weights, renormalised), casts allowed;
- the output is ``reshape(experts(...) [+ sigmoid(g(x)) * s(x) | + s(x)])``: an optional shared
  expert ``s`` with an optional sigmoid gate ``g`` (Qwen2-MoE);
- every other node of the block is a view of x or an unused router output. Anything else (router
  jitter, a returned router_logits, another activation) leaves the block as it was and says why.
The experts module's computation is proven by running it (float32, small random weights of the same
layout, its own eager implementation) against `fused_experts_ref`: SiLU-gated, [gate | up]
concatenated, routing weights applied after the down projection. Nothing is read by name.
"""

from __future__ import annotations

import contextlib
import operator

import torch
from torch import nn
from torch.func import functional_call

from fxrewrite import nodes, origin, tracer
from fxrewrite.kernels.fused_moe import fused_experts_ref
from fxrewrite.layers.fused_moe import FusedExperts, FusedMoE
from fxrewrite.patterns.base import Context, Match, Pattern, Refusal, copy_requires_grad, require, require_unshared


def _expert_params(module: nn.Module) -> tuple[str, str] | None:
    """(w13 name, w2 name) when the module's only parameters are [E, 2I, H] and [E, H, I]; else None."""
    params = dict(module.named_parameters())
    if len(params) != 2 or list(module.buffers()) or any(p.dim() != 3 for p in params.values()):
        return None
    (na, a), (nb, b) = params.items()
    fits = [(x, y) for (x, p), (y, q) in (((na, a), (nb, b)), ((nb, b), (na, a)))
            if p.shape[0] == q.shape[0] and p.shape[1] == 2 * q.shape[2] and p.shape[2] == q.shape[1]]
    return fits[0] if len(fits) == 1 else None


def _arg(node):
    return nodes.peel(node)


def _router_facts(router_node, block_root: nn.Module, ids_idx: int, w_idx: int) -> dict:
    """Trace the router class and read (scoring, renormalize, top_k, bias) off its graph; Refusal if not."""
    module = block_root.get_submodule(router_node.target)
    args = tuple(tracer.to_meta(nodes.meta(a)) if isinstance(a, torch.fx.Node) else a for a in router_node.args)
    traced = tracer.trace(module, args, {})
    require(not traced.partial, f"router {router_node.target} could not be traced: {traced.error}")
    outs = nodes.output_value(traced.graph)
    require(isinstance(outs, tuple) and len(outs) > max(ids_idx, w_idx), "router output is not a tuple")
    ids, w = _arg(outs[ids_idx]), _arg(outs[w_idx])
    require(nodes.is_op(ids, operator.getitem) and ids.args[1] == 1, "router indices are not topk(...)[1]")
    topk = ids.args[0]
    topk_args = dict(zip(("input", "k", "dim", "largest", "sorted"), topk.args)) | topk.kwargs
    require(nodes.is_op(topk, torch.topk, "topk") and topk_args.get("dim", -1) in (-1, 1)
            and topk_args.get("largest", True) is True and isinstance(topk_args.get("k"), int),
            "router does not take topk over the experts")
    if nodes.is_op(w, torch.softmax, torch.nn.functional.softmax, "softmax"):
        # softmax over the top-k logits (Granite-MoE): the same as softmax over all experts, top-k, renormalised
        require(_softmax_dim(w) in (-1, 1), "routing softmax is not over the top-k")
        w, scoring, renormalize, logits = _arg(w.args[0]), "softmax", True, _arg(topk.args[0])
    else:
        renormalize = nodes.is_op(w, operator.truediv, torch.div, "div")
        if renormalize:
            total = _arg(w.args[1])
            require(nodes.is_op(total, "sum", torch.sum) and total.kwargs.get("keepdim")
                    and total.args[0] is w.args[0], "routing weights are divided by something other than their sum")
            w = _arg(w.args[0])
        scores = _arg(topk.args[0])
        require(nodes.is_op(scores, torch.softmax, torch.nn.functional.softmax, torch.sigmoid, "softmax", "sigmoid"),
                "router scores are neither softmax nor sigmoid")
        scoring = "sigmoid" if "sigmoid" in str(scores.target) else "softmax"
        require(scoring == "sigmoid" or _softmax_dim(scores) in (-1, 1), "router softmax is not over the experts")
        logits = _arg(scores.args[0])
    require(nodes.is_op(w, operator.getitem) and w.args[0] is topk and w.args[1] == 0,
            "routing weights are not the top-k values")
    require(nodes.is_op(logits, torch.nn.functional.linear) and getattr(logits.args[1], "op", "") == "get_attr"
            and logits.args[1].target == "weight", "router logits are not linear(x, self.weight)")
    x, source = nodes.placeholders(traced.graph)[0], _arg(logits.args[0])
    while nodes.is_op(source, "view", "reshape") and _width(source) == _width(x) is not None:  # x's rows, in order
        source = _arg(source.args[0])
    require(source is x, f"the router's linear does not read the router's input (it reads {getattr(source, 'name', source)})")
    bias = logits.args[2] if len(logits.args) > 2 else logits.kwargs.get("bias")
    require(bias is None or getattr(bias, "op", "") == "get_attr" and bias.target == "bias", "router bias unknown")
    return {"scoring": scoring, "renormalize": renormalize, "top_k": topk_args["k"], "router_outputs": (ids_idx, w_idx),
            "weights_dtype": _router_weights_dtype(module, w_idx, bias is not None)}


def _router_weights_dtype(router: nn.Module, w_idx: int, has_bias: bool) -> str:
    """Which dtype the router rounds its routing weights to, by running it (the traced graph's casts carry the
    trace's dtype as a constant): "float32" (Mixtral: kept), "logits" (Qwen3-MoE, OLMoE: ``.to(router_logits.dtype)``,
    the autocast dtype under autocast) or "input" (Granite-MoE: ``.type_as(hidden_states)``). Transformers' experts
    multiply by the weights in that dtype, so bf16 rounds them (a fresh user's find: the fused block kept them in
    float32, off stock's bf16 output by an ulp). Refusal for a router that rounds otherwise or cannot run."""
    e, h = router.weight.shape
    gen = torch.Generator().manual_seed(0)
    params = {"weight": torch.randn(e, h, generator=gen)} | ({"bias": torch.randn(e, generator=gen)} if has_bias else {})
    x = torch.randn(3, h, generator=gen)
    try:
        with torch.no_grad():
            plain = functional_call(router, {k: v.bfloat16() for k, v in params.items()}, (x.bfloat16(),))[w_idx].dtype
            with torch.autocast("cpu", dtype=torch.bfloat16):
                autocast = functional_call(router, params, (x,))[w_idx].dtype
    except Exception as exc:  # noqa: BLE001 - a router we cannot run is not proven
        raise Refusal(f"router could not be probed: {type(exc).__name__}: {exc}") from exc
    kind = {(torch.float32, torch.float32): "float32", (torch.bfloat16, torch.bfloat16): "logits",
            (torch.bfloat16, torch.float32): "input"}.get((plain, autocast))
    require(kind is not None, f"router's routing weights are {plain} for bf16 input and {autocast} under bf16 autocast "
                              "(expected float32, the logits' dtype or the input's)")
    return kind


def _width(node) -> int | None:
    value = nodes.meta(node)
    return value.shape[-1] if value is not None and value.dim() else None


def _softmax_dim(node):
    return node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)


def _shared_branch(other, x) -> tuple[dict, set]:
    """The shared-expert term added to the experts output: ({role: child}, claimed nodes); Refusal if not."""
    gate = None
    if nodes.is_op(other, operator.mul, torch.mul):
        a, b = other.args
        sig, shared = (a, b) if nodes.is_op(a, torch.sigmoid, "sigmoid", torch.nn.functional.sigmoid) else (b, a)
        require(nodes.is_op(sig, torch.sigmoid, "sigmoid", torch.nn.functional.sigmoid), "shared term is not gated")
        gate = sig.args[0]
        require(gate.op == "call_module" and gate.args == (x,), "shared expert gate does not read x")
        claimed = {other, sig, gate}
    else:
        shared, claimed = other, set()
    require(getattr(shared, "op", "") == "call_module" and shared.args == (x,) and not shared.kwargs,
            "the term added to the experts output is not a module of x")
    names = {"shared": shared.target} | ({"shared_gate": gate.target} if gate is not None else {})
    return names, claimed | {shared}


def _node_names(args) -> str:
    return ", ".join(a.name if isinstance(a, torch.fx.Node) else repr(a) for a in args) or "nothing"


def _experts_nodes(traced) -> list:
    root = traced.module
    return [n for n in traced.graph.nodes if n.op == "call_module" and len(n.args) == 3
            and _expert_params(root.get_submodule(n.target)) is not None]


class MoEPattern(Pattern):
    """See module docstring."""

    name = "moe"
    scope = "module"

    @classmethod
    def match(cls, traced, ctx: Context) -> list[Match]:
        found = _experts_nodes(traced)
        if not found:
            return []
        require(len(found) == 1, f"{len(found)} experts calls in one block")
        require(not traced.partial, f"block could not be traced: {traced.error}")
        ex = found[0]
        x, ids, w = ex.args
        require(nodes.is_op(ids, operator.getitem) and nodes.is_op(w, operator.getitem)
                and ids.args[0] is w.args[0], "expert ids and weights do not come from one router call")
        router = ids.args[0]
        require(router.op == "call_module" and router.args == (x,) and not router.kwargs,
                f"the router call reads {_node_names(router.args)}, the experts read {x.name} (not the same tensor)")
        facts = _router_facts(router, traced.module, ids.args[1], w.args[1])
        names = {"router": router.target, "experts": ex.target}
        claimed = {ex, router, ids, w} | {u for u in router.users if not u.users}
        out = nodes.output_value(traced.graph)
        require(isinstance(out, torch.fx.Node) and nodes.is_op(out, "reshape", "view"), "block output is not reshaped")
        final = out.args[0]
        claimed.add(out)
        if final is not ex:
            require(nodes.is_op(final, operator.add, torch.add) and ex in final.args, "experts output is not returned")
            shared_names, shared_claimed = _shared_branch(final.args[1] if final.args[0] is ex else final.args[0], x)
            names |= shared_names
            claimed |= shared_claimed | {final}
        require(x.op == "placeholder" or nodes.is_op(x, "view", "reshape") and x.args[0].op == "placeholder",
                "experts input is not the block input")
        claimed.add(x)
        rest = [n.name for n in traced.graph.nodes if n.op not in ("placeholder", "output") and n not in claimed]
        require(not rest, f"block computes more than routing, experts and a shared expert: {rest}")
        facts["probe_h"] = nodes.meta(x).shape[-1]
        return [Match(cls, frozenset(n.name for n in claimed), tuple(names.items()), tuple(sorted(facts.items())))]

    @classmethod
    def validate(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        experts = module.get_submodule(match.name("experts"))
        pnames = _expert_params(experts)
        require(pnames is not None, "experts parameters are not [E, 2I, H] and [E, H, I] on this instance")
        e = getattr(experts, pnames[0]).shape[0]
        require(match.fact("top_k") <= e, f"top_k={match.fact('top_k')} exceeds the {e} experts")
        router = module.get_submodule(match.name("router"))
        require(tuple(router.weight.shape) == (e, getattr(experts, pnames[0]).shape[2]), "router weight is not [E, H]")
        _require_own_implementation(experts)
        require_unshared(ctx, module.get_submodule(match.name("experts").rpartition(".")[0]),
                         {match.name("experts"): experts})
        _probe_experts(experts, pnames, match.fact("top_k"))

    @classmethod
    def build(cls, match: Match, module: nn.Module, ctx: Context) -> nn.Module:
        old = module.get_submodule(match.name("experts"))
        w13_name, w2_name = _expert_params(old)
        w13, w2 = getattr(old, w13_name), getattr(old, w2_name)
        e, two_i, h = w13.shape
        experts = FusedExperts(e, h, two_i // 2, params_dtype=w13.dtype, device=w13.device,
                               param_names=(w13_name, w2_name))
        if w13.device.type != "meta":
            experts.weight_loader(experts.w13, w13.detach())
            experts.weight_loader(experts.w2, w2.detach())
        copy_requires_grad(experts, old)
        experts.keep_children(dict(old.named_children()))
        children = {role: module.get_submodule(name) for role, name in match.names}
        children["experts"] = experts
        return FusedMoE(dict(match.names), children, top_k=match.fact("top_k"),
                        renormalize=match.fact("renormalize"), scoring_func=match.fact("scoring"),
                        router_outputs=match.fact("router_outputs"), weights_dtype=match.fact("weights_dtype"))

    @classmethod
    def describe(cls, match: Match) -> str:
        shared = "+ shared expert " if "shared" in dict(match.names) else ""
        norm = ", renormalized" if match.fact("renormalize") else ""
        return (f"{match.name('router')},{match.name('experts')} {shared}-> FusedMoE "
                f"({match.fact('scoring')} top-{match.fact('top_k')}{norm})")


@contextlib.contextmanager
def _eager_experts(module: nn.Module):
    """Run transformers' experts with their eager implementation (grouped_mm refuses small probe shapes)."""
    config = getattr(module, "config", None)
    key = "_experts_implementation_internal"
    had = config is not None and key in config.__dict__
    saved = config.__dict__.get(key) if had else None
    if had:
        config.__dict__[key] = "eager"
    try:
        yield
    finally:
        if had:
            config.__dict__[key] = saved


def _require_own_implementation(experts: nn.Module) -> None:
    """Refusal unless the experts run eager code or an implementation of transformers' experts registry
    (``experts_implementation="batched_mm"`` ...) that is transformers' own: the probe runs the eager path, so a
    function registered by the user (`ALL_EXPERTS_FUNCTIONS.register`) would be replaced unproven."""
    impl = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    if impl in (None, "eager"):
        return
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:  # a transformers without the registry: nothing registered to lose
        return
    fn = ALL_EXPERTS_FUNCTIONS.get(impl)
    outside = "nothing" if fn is None else origin.outside_code(fn)
    require(outside is None, f"experts_implementation {impl!r} runs {outside}, not transformers' code")


def _probe_experts(experts: nn.Module, pnames: tuple[str, str], top_k: int) -> None:
    """Refusal unless the module computes `fused_experts_ref` on random float32 inputs."""
    e = getattr(experts, pnames[0]).shape[0]
    gen = torch.Generator().manual_seed(0)
    h, i, t = 16, 8, 6
    w13 = torch.randn(e, 2 * i, h, generator=gen) * 0.3
    w2 = torch.randn(e, h, i, generator=gen) * 0.3
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)])
    weights = torch.rand(t, top_k, generator=gen)
    try:
        with _eager_experts(experts), torch.no_grad():
            got = functional_call(experts, {pnames[0]: w13, pnames[1]: w2}, (x, ids, weights))
    except Exception as exc:  # noqa: BLE001 - an experts module we cannot run is not proven
        raise Refusal(f"experts module could not be probed: {type(exc).__name__}: {exc}") from exc
    want = fused_experts_ref(x, w13, w2, weights, ids)
    require(isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, 1e-4, 1e-5),
            "experts do not compute sum_k w * down(silu(gate) * up) with [gate | up] weights")
