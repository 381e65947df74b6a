"""Fused mixture-of-experts layers: `FusedExperts` (the expert weights) and `FusedMoE` (the whole block).

`FusedExperts` holds w13 ``gate_up_proj`` [E, 2I, H] ([gate | up] per expert) and w2 ``down_proj``
[E, H, I], named and laid out as transformers 5's experts modules name them, so checkpoints (after
transformers' own conversion of per-expert tensors) and ``state_dict()`` need no name map.
Parallelism (vLLM's two modes):
- tensor parallel (default): every rank holds all experts and 1/tp of each expert's intermediate
  columns (w13 rows of gate and of up, w2 columns); outputs are partial sums, all-reduced.
- expert parallel (``enable_expert_parallel``): rank r holds experts [r*E/tp, (r+1)*E/tp) whole;
  slots routed elsewhere contribute zero here; outputs are partial sums, all-reduced.
`FusedMoE` routes (router linear -> softmax/sigmoid -> top-k -> optional renormalisation, as in
transformers' ``*TopKRouter``), runs the experts, adds an optional shared expert scaled by
``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE) and reduces over the tensor-parallel ranks.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.utils import output_capturing

from fxrewrite.data_parallel import dp_ep_active
from fxrewrite.distributed import tensor_model_parallel_all_reduce
from fxrewrite.kernels.batch_invariant import is_batch_invariant
from fxrewrite.kernels.fused_moe import SCORING, fused_experts
from fxrewrite.kernels import moe_router_tune
from fxrewrite.kernels.moe_norm_router import norm_route_experts
from fxrewrite.kernels.moe_router import route_experts
from fxrewrite.layers.fold_guard import global_module_hooks, unhooked
from fxrewrite.layers.moe_dp import experts_across_dp
from fxrewrite.signature import HOOK_DICTS

ROUTING_WEIGHT_DTYPES = ("float32", "logits", "input")
"""`FusedMoE(weights_dtype=...)`: what the replaced router rounds its routing weights to (see `round_routing_weights`)."""

def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by the parallel size {d}")
    return n // d


_KEPT_ATTR = "_fxrewrite_kept_children"


class FusedExperts(nn.Module):
    """E experts of a SiLU-gated MLP; x [T, H] with routing [T, K] -> partial output [T, H].

    Raises ValueError when the expert count (expert parallel) or the intermediate size (tensor
    parallel) does not divide by tp_size.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, tp_size: int = 1,
                 tp_rank: int = 0, expert_parallel: bool = False, params_dtype: torch.dtype | None = None,
                 device=None, param_names: tuple[str, str] = ("gate_up_proj", "down_proj")) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.tp_size, self.tp_rank, self.expert_parallel = tp_size, tp_rank, expert_parallel
        if expert_parallel:
            self.num_local_experts = _divide(num_experts, tp_size, "num_experts")
            self.intermediate_size_per_partition = intermediate_size
        else:
            self.num_local_experts = num_experts
            self.intermediate_size_per_partition = _divide(intermediate_size, tp_size, "moe intermediate_size")
        self.expert_start = tp_rank * self.num_local_experts if expert_parallel else 0
        e, i = self.num_local_experts, self.intermediate_size_per_partition
        factory = {"dtype": params_dtype or torch.get_default_dtype(), "device": device}
        self.param_names = tuple(param_names)  # the replaced module's names: state_dict keys stay the same
        self.register_parameter(param_names[0], nn.Parameter(torch.empty(e, 2 * i, hidden_size, **factory)))
        self.register_parameter(param_names[1], nn.Parameter(torch.empty(e, hidden_size, i, **factory)))
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader

    def keep_children(self, children: dict[str, nn.Module]) -> None:
        """Register the replaced experts module's own children (transformers' ``act_fn``) under their names, as the
        stock module tree has them, each marked as kept; a forward then refuses one replaced or hooked since
        (`_check_kept`). Names and a flag, not module references: instances stay alike (`fxrewrite.signature`)."""
        for name, child in children.items():
            if not hasattr(self, name):
                self.add_module(name, child)
                child.__dict__[_KEPT_ATTR] = True
        self.__dict__[_KEPT_ATTR] = tuple(n for n, c in children.items() if self._modules.get(n) is c)

    def kept_children(self) -> dict[str, nn.Module]:
        """The children `keep_children` registered, by name."""
        return {n: self._modules[n] for n in self.__dict__.get(_KEPT_ATTR, ()) if n in self._modules}

    def _check_kept(self) -> None:
        """RuntimeError when a kept child was replaced or hooked after `optimize` (a fresh user's find: a new
        ``experts.act_fn`` was silently ignored): the kernels compute the activation proven at `optimize`."""
        if torch.compiler.is_compiling():
            return
        for name in self.__dict__.get(_KEPT_ATTR, ()):
            now = self._modules.get(name)
            kept = now is not None and now.__dict__.get(_KEPT_ATTR)
            if not kept or any(now.__dict__.get(h) for h in HOOK_DICTS) or "forward" in now.__dict__:
                raise RuntimeError(f"experts.{name} was {'hooked' if kept else 'replaced'} after "
                                   "fxrewrite.optimize, but the fused experts compute the activation proven then "
                                   "(SiLU-and-mul), not this module: make the change before optimize (an experts "
                                   "module so changed is left unfused)")

    @property
    def w13(self) -> nn.Parameter:
        """[E_local, 2 * I_local, H]: [gate | up] rows per expert."""
        return getattr(self, self.param_names[0])

    @property
    def w2(self) -> nn.Parameter:
        """[E_local, H, I_local]."""
        return getattr(self, self.param_names[1])

    def full_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        """The checkpoint's shape of `param` (w13 [E, 2I, H], w2 [E, H, I]: every expert, full width), which the
        loader and in-place weight sync (`fxrewrite.runtime.worker.weight_sync`) take whatever this rank holds."""
        if param is self.w13:
            return (self.num_experts, 2 * self.intermediate_size, self.hidden_size)
        return (self.num_experts, self.hidden_size, self.intermediate_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id=None) -> None:
        """Copy this rank's part of a full checkpoint tensor ([E, 2I, H] or [E, H, I]; a LazySlice reads only it)."""
        e, i = self.num_local_experts, self.intermediate_size_per_partition
        full_i = self.intermediate_size
        expected = self.full_shape(param)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"expert weight shape {tuple(loaded_weight.shape)} != expected {expected}")
        w = loaded_weight.narrow(0, self.expert_start, e)
        if not self.expert_parallel and self.tp_size > 1:
            start = self.tp_rank * i
            if param is self.w13:
                w = torch.cat([w.narrow(1, start, i), w.narrow(1, full_i + start, i)], dim=1)
            else:
                w = w.narrow(2, start, i)
        if param.device.type != "meta":
            with torch.no_grad():
                param.copy_(w)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states [T, H], routing [T, K] (ids, then weights: transformers' experts' order, so that a hook
        written for them reads the same arguments) -> [T, H]; with `residual` [T, H] ``residual + out``
        (`fused_experts`)."""
        self._check_kept()
        return fused_experts(hidden_states, self.w13, self.w2, top_k_weights, top_k_index, self.expert_start, residual)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, local={self.num_local_experts}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size_per_partition}, expert_parallel={self.expert_parallel}")


class FusedMoE(nn.Module):
    """A sparse MoE block: hidden_states [..., H] -> [..., H], same dtype.

    Children keep the names of the block they replace (``names``: role -> attribute, roles
    "router" (any module with ``weight`` [E, H] and optional ``bias``), "experts" (`FusedExperts`),
    optional "shared" (a module x -> [T, H]) and "shared_gate" (x -> [T, 1])), so parameter names
    are unchanged. ValueError for an unknown scoring function or top_k outside [1, E].
    """

    def __init__(self, names: dict[str, str], modules: dict[str, nn.Module], *, top_k: int, renormalize: bool,
                 scoring_func: str = "softmax", router_outputs: tuple[int, int] | None = None,
                 weights_dtype: str = "float32") -> None:
        super().__init__()
        if scoring_func not in SCORING:
            raise ValueError(f"scoring_func={scoring_func!r}, expected one of {SCORING}")
        if weights_dtype not in ROUTING_WEIGHT_DTYPES:
            raise ValueError(f"weights_dtype={weights_dtype!r}, expected one of {ROUTING_WEIGHT_DTYPES}")
        experts = modules["experts"]
        if not 1 <= top_k <= experts.num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={experts.num_experts}")
        self.names = dict(names)
        self.top_k, self.renormalize, self.scoring_func = top_k, renormalize, scoring_func
        # the dtype the replaced router rounds its routing weights to (patterns/moe.py `_router_weights_dtype`)
        self.weights_dtype = weights_dtype
        # where the replaced block read (ids, weights) in its router module's output, and that module's plain
        # attributes then (top_k, norm_topk_prob, ...): a hook put on it since, or a changed attribute, makes its own
        # forward route (`_router_routes`). None: a router that outputs logits only (native models)
        self.router_outputs = router_outputs
        self.router_state = _plain_state(modules["router"]) if router_outputs is not None else None
        for role, name in self.names.items():
            setattr(self, name, modules[role])

    def __call__(self, *args, **kwargs):
        """The folded call ``block(e, norm=..., residual=r, add_residual=...)`` (patterns/rms_norm.py) runs as
        transformers' layer does, ``x, r = norm(e, r); out = block(x)``, whenever the block is hooked (forward or
        backward, with or without kwargs, a global module hook, a forward put on its instance): every hook then sees
        the block's own call and output (a fresh user's find: with-kwargs and backward hooks saw the folded call,
        and a backward hook's change leaked into the residual stream)."""
        norm = kwargs.get("norm")
        if norm is None or unhooked(self):
            return super().__call__(*args, **kwargs)
        x, residual = norm(args[0], kwargs["residual"])
        out = super().__call__(x)
        return (residual + out if kwargs.get("add_residual") else out), residual

    def _child(self, role: str) -> nn.Module | None:
        name = self.names.get(role)
        return getattr(self, name) if name else None

    def forward(self, hidden_states: torch.Tensor, norm: nn.Module | None = None,
                residual: torch.Tensor | None = None, add_residual: bool = False):
        """hidden_states [..., H] -> [..., H]; with `norm` (and `residual` [..., H]): `forward_norm`'s
        (out, new residual), the form the rewrite's residual fold calls (patterns/rms_norm.py)."""
        if norm is not None:
            return self.forward_norm(hidden_states, norm, residual, add_residual)
        if residual is not None or add_residual:
            raise ValueError("FusedMoE: residual and add_residual belong to the folded norm's call (norm=...)")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if dp_ep_active():  # data-parallel replicas share the experts (fxrewrite.layers.moe_dp)
            out = experts_across_dp(self, x)
        else:
            out = self._experts(x)
        return self._add_shared(x, out).reshape(shape)

    def forward_norm(self, hidden_states: torch.Tensor, norm: nn.Module, residual: torch.Tensor,
                     add_residual: bool = False):
        """``x, residual = norm(hidden_states, residual); return self(x), residual`` (norm: the layer's
        RMSNorm, vLLM's fused-add form), with the norm folded into the router launch at decode
        (`fxrewrite.kernels.moe_norm_router`) when nothing else needs the plain path. `add_residual`: return
        ``residual + self(x)`` in place of ``self(x)`` (the layer's closing add; in the down kernel at decode)."""
        router = self._child("router")
        if (dp_ep_active() or getattr(router, "bias", None) is not None or torch.compiler.is_compiling()
                or router_logits_wanted(router) or self._router_routes(router) or _user_hooked(self._child("experts"))
                # training: the norm module's autograd pair; batch-invariant: the path a trainer's recomputation takes
                or torch.is_grad_enabled() or is_batch_invariant()
                or getattr(norm, "offset", None) != 0.0 or not getattr(norm, "upcast", False)
                or not unhooked(norm)):  # a hook on the norm sees its call
            x, residual = norm(hidden_states, residual)
            out = self(x)
            return (residual + out if add_residual else out), residual
        shape = hidden_states.shape
        weights, ids, x, residual = norm_route_experts(
            hidden_states.reshape(-1, shape[-1]), residual.reshape(-1, shape[-1]), norm.weight,
            norm.variance_epsilon, router.weight, self.top_k, self.renormalize, self.scoring_func,
            weights_dtype=self.routing_dtype(hidden_states))
        if add_residual and self._child("shared") is None:
            out = self._run_experts(x, weights, ids, residual)
        else:
            out = self._add_shared(x, self._run_experts(x, weights, ids))
            out = residual + out if add_residual else out
        return out.reshape(shape), residual.reshape(shape)

    def _add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        shared = self._child("shared")
        if shared is not None:
            s = shared(x)
            gate = self._child("shared_gate")
            out = out + (torch.sigmoid(gate(x)) * s if gate is not None else s)
        return out

    def _router_routes(self, router: nn.Module) -> bool:
        """The router module's own forward must give this call's routing: a hook on it, or one of its plain
        attributes changed since `optimize` proved the routing (its top_k, norm_topk_prob...), which the fused
        routing would not see (a fresh user's find: both were silently ignored). Not while torch.compile traces
        (the compiled graph keeps what it traced)."""
        if self.router_outputs is None or torch.compiler.is_compiling():
            return False
        return _user_hooked(router) or _plain_state(router) != self.router_state

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        router = self._child("router")
        if self._router_routes(router):
            out = router(x)
            return self._run_experts(x, out[self.router_outputs[1]], out[self.router_outputs[0]])
        # its own forward, for transformers' recorder hook (the same weight routes below); also whenever autograd
        # records: activation checkpointing's recomputation runs without the collector and must save what the
        # forward saved (a call only the first pass made was a CheckpointError with output_router_logits=True)
        if torch.is_grad_enabled() or router_logits_wanted(router):
            router(x)
        # a few tokens (decode): gate GEMV + top-k in one launch (fxrewrite.kernels.moe_router)
        weights, ids = route_experts(x, router.weight, self.top_k, self.renormalize, self.scoring_func,
                                     getattr(router, "bias", None), weights_dtype=self.routing_dtype(x))
        return self._run_experts(x, weights, ids)

    def _run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' output [T, H], all-reduced over tensor-parallel ranks; ``residual + `` it when given
        (in the experts' kernel on one rank, after the all-reduce on several)."""
        experts = self._child("experts")
        weights = self.round_routing_weights(weights, x)
        if experts.tp_size == 1 and not (residual is not None and _user_hooked(experts)):
            return experts(x, ids, weights, residual)  # a hook on it sees its own output, as on stock's experts
        out = experts(x, ids, weights)
        out = out if experts.tp_size == 1 else tensor_model_parallel_all_reduce(out)
        return out if residual is None else residual + out

    def round_routing_weights(self, weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """weights [T, K] cast to `routing_dtype` (a no-op for the router kernels' weights, stored in it). The
        reference experts then round ``out * weights`` as transformers' experts do (under autocast a bf16 product,
        then x's dtype); the kernels read such weights as float32 (their values rounded)."""
        return weights if not weights.is_floating_point() else weights.to(self.routing_dtype(x))

    def routing_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype the replaced router gave its routing weights in for input x [T, H] (`weights_dtype`:
        "float32"; "logits", the router linear's output dtype, the autocast dtype under autocast; "input", x's)."""
        kind = getattr(self, "weights_dtype", "float32")  # a FusedMoE pickled before the attribute: float32
        if kind == "float32":
            return torch.float32
        if kind == "input":
            return x.dtype
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return torch.promote_types(x.dtype, self._child("router").weight.dtype)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, renormalize={self.renormalize}, scoring_func={self.scoring_func!r}"


def router_logits_wanted(router: nn.Module) -> bool:
    """Whether this forward runs under transformers' output collector with ``output_router_logits`` (the MoE
    auxiliary loss): transformers records router logits with a forward hook on the router module, so the router
    module must run (a fused block otherwise reads only its weight). transformers installs its recorder hooks on
    the first call that asks for any output; before that (serving, plain training) the collector is not read:
    dynamo cannot trace a ContextVar read outside transformers' own compiled wrapper (a graph break per layer in
    a regionally compiled decoder layer)."""
    if not router._forward_hooks:
        return False
    collector = getattr(output_capturing, "_active_collector", None)  # transformers 5.x's, checked 5.17 to 5.25
    outputs = collector.get() if collector is not None else None
    return outputs is not None and "router_logits" in outputs


def prepare_moe_router(model: nn.Module, device: torch.device, dtype: torch.dtype) -> dict:
    """Time the router launch shapes of every `FusedMoE` router shape in `model` on a CUDA `device` and
    record the fastest (`fxrewrite.kernels.moe_router_tune.tune`); {} on CPU or without MoE blocks."""
    shapes = set()
    for module in model.modules():
        if isinstance(module, FusedMoE) and getattr(module._child("router"), "bias", None) is None:
            e, h = module._child("router").weight.shape
            shapes.add((e, h, module.top_k, module.renormalize, module.scoring_func))
    return moe_router_tune.tune(shapes, device, dtype) if shapes else {}


def _plain_state(module: nn.Module) -> dict:
    """`module`'s public attributes of plain Python values (ints, floats, bools, strings, None): what a router's
    forward reads besides its weight."""
    return {k: v for k, v in vars(module).items()
            if not k.startswith("_") and k != "training" and (v is None or isinstance(v, (bool, int, float, str)))}


def _user_hooked(module: nn.Module) -> bool:
    """A forward / backward hook on `module`, or a global module hook, other than transformers' output recorders
    (installed on the first call asking for router logits; they only read)."""
    return global_module_hooks() or any(getattr(h, "__module__", None) != output_capturing.__name__
                                        for d in HOOK_DICTS for h in module.__dict__.get(d, {}).values())
