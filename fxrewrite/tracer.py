"""All-leaf fx tracer over meta tensors: one dataflow graph per module structure, for pattern matching.

1. `record_calls(model)` runs the whole model once on the meta device (parameters and buffers swapped
   for meta twins with `torch.func.functional_call`; nothing computed or moved) and records the
   arguments each module's `forward` received: the tracer knows real shapes, not the architecture.
2. `trace(module, args, kwargs)` runs `type(module).forward` under `torch.fx` with every child
   module a leaf (`call_module` node), every tensor value carried as a meta tensor in
   ``node.meta["val"]``. Shapes, dtypes and devices come back as plain Python values, so
   `.shape`, `len()`, unpacking and `.view(*shape)` work; the graph is specialised to them and is
   only ever inspected, never run. The attention call is one leaf (`attention`), and functions defined
   in the module's own source file (such as `apply_rotary_pos_emb`) are leaves too, so a pattern can
   point at the call in the source. An untraceable statement ends the graph; `Traced.error` says why.

Nothing here knows any pattern or model (design rule: tracer and source never import patterns).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import types
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch import nn
from torch.func import functional_call
from torch.fx.node import map_aggregate

from fxrewrite import hub_kernels
from fxrewrite.meta_memo import MetaMemo, memoized, with_parameters
from fxrewrite.signature import structure_keys
from fxrewrite.size_reads import LoggedSize, note_size_read
from fxrewrite.tensor_state import preserved_state
from fxrewrite.trace_errors import error_location

_TENSOR_PROPERTIES = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "is_meta", "layout"})
_STATIC_METHODS = frozenset({"size", "dim", "numel", "is_floating_point", "is_contiguous", "get_device"})
_STATIC_TYPES = (int, float, bool, str, torch.dtype, torch.device, torch.Size, type(None))
_UNKNOWN = "<unknown>"  # meta value of a node whose value could not be computed


class TraceFailure(RuntimeError):
    """A statement needs a value the tracer does not have (data-dependent or unknown)."""


@dataclasses.dataclass
class Traced:
    """The fx graph of one module class, traced through its first instance."""

    module: nn.Module
    """The instance that was traced (its values are read only for shapes)."""
    graph: fx.Graph
    """Nodes in program order; ``node.meta["val"]`` holds meta tensors / Python values."""
    error: str | None = None
    """None for a complete trace; else "file:line: message" of the first untraceable statement."""

    @property
    def partial(self) -> bool:
        return self.error is not None


def attention(module: Any, query, key, value, attention_mask, **kwargs):
    """Stand-in for transformers' attention functions while tracing: one leaf node.

    query [B, Hq, S, D], value [B, Hkv, S_kv, Dv] -> (out [B, S, Hq, Dv], None), the layout every
    transformers attention function returns. Only shapes are produced (meta tensors).
    """
    tracer = _proxy_tracer((query, key, value, attention_mask, kwargs))
    if tracer is not None:
        return tracer.create_proxy("call_function", attention, ("self", query, key, value, attention_mask), kwargs)
    b, h, s, _ = query.shape
    out = torch.empty((b, s, h, value.shape[-1]), dtype=query.dtype, device="meta")
    return out, None


def _proxy_tracer(obj) -> fx.Tracer | None:
    found: list[fx.Proxy] = []
    map_aggregate(obj, lambda a: found.append(a) if isinstance(a, fx.Proxy) else None)
    return found[0].tracer if found else None


@contextlib.contextmanager
def attention_as_leaf() -> Iterator[None]:
    """Route transformers' attention registry lookups to `attention` while tracing."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.get_interface = lambda *args, **kwargs: attention
    try:
        yield
    finally:
        del ALL_ATTENTION_FUNCTIONS.get_interface


def to_meta(value):
    """Tensors -> meta tensors of the same shape/dtype (recursively); other values unchanged."""
    def convert(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, fx.Proxy) and not t.is_meta:
            return torch.empty_like(t, device="meta")
        return t
    return map_aggregate(value, convert)


def run_on_meta(module: nn.Module, args, kwargs, keep: frozenset = frozenset()):
    """Call `module` with every parameter and buffer replaced by a meta twin (no data touched).

    Buffers named in `keep` stay real (see `_buffer_modules_on_cpu`).
    """
    state = {name: to_meta(t) for name, t in module.named_parameters(remove_duplicate=False)}
    state.update({name: to_meta(t) for name, t in module.named_buffers(remove_duplicate=False) if name not in keep})
    return functional_call(module, state, tuple(args), dict(kwargs), tie_weights=False, strict=False)


def record_inputs(model: nn.Module, seq_len: int = 5, example_inputs: tuple | None = None
                  ) -> tuple[dict[type, tuple], str | None]:
    """({class: (instance, args, kwargs)} of the first call of each class, error): see `record_calls`."""
    calls, error = record_calls(model, seq_len, example_inputs)
    records: dict[type, tuple] = {}
    for module, args, kwargs in calls.values():
        records.setdefault(type(module), (module, args, kwargs))
    return records, error


def record_calls(model: nn.Module, seq_len: int = 5, example_inputs: tuple | None = None,
                 memo: MetaMemo | None = None) -> tuple[dict[int, tuple], str | None]:
    """Run `model` on meta inputs; return ({id(module): (module, args, kwargs)} in call order, error).

    Default inputs: a causal LM's input_ids [1, seq_len] and an all-ones attention mask; `example_inputs` =
    (args, kwargs) replaces them (tensors turned into meta tensors). The first call of each module is kept.
    Modules with parameters run through `memo` (`fxrewrite.meta_memo`): one repeating an earlier module's
    structure and inputs is not run; its descendants get that module's descendants' inputs. `error`: the
    exception text when the run stopped early (what was recorded before it is still returned)."""
    records: dict[int, tuple] = {}
    memo = memo if memo is not None else MetaMemo()
    memoizable = with_parameters(model)
    keys = structure_keys(model)  # before our own hooks make every key unique

    def hook(module, args, kwargs):
        records.setdefault(id(module), (module, args, dict(kwargs)))

    input_ids = torch.zeros((1, seq_len), dtype=torch.long, device="meta")
    args, kwargs = example_inputs or ((), {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                                           "use_cache": False})
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules()]  # removed in finally
    error = None
    try:
        with preserved_state(model), attention_as_leaf(), _eager_masks(model), \
                _buffer_modules_run_real(model) as keep, torch.no_grad(), \
                memoized(memoizable, memo, lambda m: keys[id(m)]):
            run_on_meta(model, to_meta(tuple(args)), to_meta(dict(kwargs)), keep)
    except Exception as e:  # noqa: BLE001 - any failure just ends the recording
        error = f"{type(e).__name__}: {e}"
    finally:
        for handle in handles:
            handle.remove()
    for skipped, stand_in in memo.aliases.values():  # same structure: descendants pair up in order
        for b, a in zip(skipped().modules(), stand_in().modules()):
            if id(b) not in records and id(a) in records:
                records[id(b)] = (b, *records[id(a)][1:])
    return records, error


@contextlib.contextmanager
def _buffer_modules_run_real(model: nn.Module) -> Iterator[frozenset]:
    """Let parameter-free modules with real buffers (rotary tables) run for real when meta fails.

    Such a module (dynamic RoPE compares positions, which meta tensors cannot) is called with
    zeros of the recorded shapes on its buffers' device, and its outputs turned into meta
    tensors: only shapes matter here. Yields the buffer names to keep real during the run.
    """
    keep, patched = set(), []
    for prefix, module in model.named_modules():
        buffers = [b for b in module.buffers()]
        if any(True for _ in module.parameters()) or not buffers or any(b.is_meta for b in buffers):
            continue
        keep.update(f"{prefix}.{n}" if prefix else n for n, _ in module.named_buffers())
        device = buffers[0].device

        def forward(*args, __forward=module.forward, __device=device, **kwargs):
            def real(t):
                return torch.zeros(t.shape, dtype=t.dtype, device=__device) if isinstance(t, torch.Tensor) else t
            return to_meta(__forward(*map_aggregate(args, real), **map_aggregate(kwargs, real)))

        had = "forward" in module.__dict__
        patched.append((module, had, module.__dict__.get("forward")))
        module.forward = forward
    try:
        yield frozenset(keep)
    finally:
        for module, had, old in patched:
            if had:
                module.forward = old
            else:
                del module.forward


@contextlib.contextmanager
def _eager_masks(model: nn.Module) -> Iterator[None]:
    """Build masks the eager way during recording (a serving backend's mask hook needs its context);
    run transformers' experts as "batched_mm", whose shapes do not depend on the routing (the eager
    loop and grouped_mm cannot run on meta tensors)."""
    keys = {"_attn_implementation_internal": "eager", "_experts_implementation_internal": "batched_mm"}
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and hasattr(c, "_attn_implementation_internal")}
    saved = {(key, k): c.__dict__.get(k) for key, c in configs.items() for k in keys if k in c.__dict__}
    for c in configs.values():
        for k, v in keys.items():
            if k != "_experts_implementation_internal" or k in c.__dict__:
                c.__dict__[k] = v
    try:
        yield
    finally:
        for (key, k), v in saved.items():
            configs[key].__dict__[k] = v


class MetaProxy(fx.Proxy):
    """An fx Proxy that answers shape questions from its meta value."""

    def __getattr__(self, name: str):
        val = self.node.meta.get("val")
        if name in _TENSOR_PROPERTIES and isinstance(val, torch.Tensor):
            return LoggedSize(val.shape, self.node) if name == "shape" else getattr(val, name)
        return super().__getattr__(name)

    def __len__(self) -> int:
        val = self.node.meta.get("val")
        if isinstance(val, (tuple, list, torch.Tensor)):
            return len(val)
        raise TraceFailure(f"len() of {self.node.name}, whose value is unknown")

    def __iter__(self):
        return iter([self[i] for i in range(len(self))])

    def __bool__(self) -> bool:
        raise TraceFailure(f"control flow depends on the value of {self.node.name}")

    def keys(self):
        raise TraceFailure(f"** unpacking of {self.node.name}")


class AllLeafTracer(fx.Tracer):
    """fx Tracer where every child module is a leaf and values are meta tensors (see module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self._executing = 0  # > 0 while computing a meta value: run code for real, trace nothing

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return MetaProxy(node, self)

    def call_module(self, m, forward, args, kwargs):
        if self._executing:
            return forward(*args, **kwargs)
        if hub_kernels.pristine(m) and not any(m is sub for sub in self.root.modules()):
            # kernels' decorated function, reached as a module attribute (modeling_llama.apply_rotary_pos_emb): not a
            # submodule fx could name, so one call of the function it wraps, as the forward's own globals give it
            return self.create_proxy("call_function", hub_kernels.decorated_function(m), args, kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self._executing:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def create_arg(self, a):
        if a is self.root:
            return "self"
        try:
            return super().create_arg(a)
        except (NotImplementedError, RuntimeError, TypeError):
            return f"<{type(a).__name__}>"  # opaque object: kept as a label, never a dataflow edge

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        val = self._meta_value(kind, target, args, kwargs)
        if kind in ("call_function", "call_method") and _is_static(val):
            if kind == "call_method" and target in ("size", "numel") and isinstance(args[0], fx.Proxy):
                return note_size_read(args[0].node, target, tuple(args[1:]) + tuple(kwargs.values()), val)
            return val  # shape arithmetic folds to constants
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        proxy.node.meta["val"] = val
        return proxy

    def _meta_value(self, kind, target, args, kwargs):
        if kind == "get_attr":
            self._executing += 1
            try:
                return to_meta(_fetch_attr(self.root, target))
            finally:
                self._executing -= 1
        if kind not in ("call_function", "call_method", "call_module"):
            return _UNKNOWN
        unknown = []
        margs, mkwargs = map_aggregate((args, kwargs), lambda a: _value_of(a, unknown))
        if unknown:
            return _UNKNOWN
        self._executing += 1
        try:
            if kind == "call_function":
                return target(*margs, **mkwargs)
            if kind == "call_method":
                return getattr(margs[0], target)(*margs[1:], **mkwargs)
            return run_on_meta(self.root.get_submodule(target), margs, mkwargs)
        except Exception:  # noqa: BLE001 - an op that fails on meta just has an unknown value
            return _UNKNOWN
        finally:
            self._executing -= 1

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        args, kwargs = concrete_args  # (args, kwargs) recorded for this instance

        def placeholder(name, value):
            if not _holds_tensor(value):
                return value  # None, flags, caches, configs: traced as constants
            proxy = self.create_proxy("placeholder", name, (), {})
            proxy.node.meta["val"] = to_meta(value)
            return proxy

        params = list(inspect.signature(inspect.unwrap(root_fn)).parameters.values())
        pos = [placeholder(params[i + 1].name if i + 1 < len(params) else f"arg{i}", a) for i, a in enumerate(args)]
        kw = {k: placeholder(k, v) for k, v in kwargs.items()}
        return (lambda root: root_fn(root, *pos, **kw)), [self.root]


def _fetch_attr(root: nn.Module, target: str):
    obj = root
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def _value_of(a, unknown: list):
    if isinstance(a, fx.Proxy):
        val = a.node.meta.get("val", _UNKNOWN)
        if isinstance(val, str) and val == _UNKNOWN:
            unknown.append(a)
        return val
    return to_meta(a)


def _holds_tensor(value) -> bool:
    found: list = []
    map_aggregate(value, lambda a: found.append(a) if isinstance(a, torch.Tensor) else None)
    return bool(found)


def _is_static(val) -> bool:
    if isinstance(val, (tuple, list)):
        return all(_is_static(v) for v in val)
    return isinstance(val, _STATIC_TYPES) and not (isinstance(val, str) and val == _UNKNOWN)


@contextlib.contextmanager
def _local_functions_as_leaves(cls: type, tracer: AllLeafTracer) -> Iterator[None]:
    """Make plain functions defined in the file of `cls.forward` leaf calls while tracing (its globals patched for
    the duration of the trace, then restored), and so the functions of ``kernels``' decorated instances that file
    imports from a transformers modeling file (a custom or remote-code model's ``from ...modeling_llama import
    apply_rotary_pos_emb``: on transformers >= 5.25 a module instance, not installed in the model, which fx
    cannot record)."""
    namespace = inspect.unwrap(cls.forward).__globals__
    originals, leaves = {}, {}
    for k, v in namespace.items():
        f = hub_kernels.decorated_function(v) if hub_kernels.pristine(v) else v  # >= 5.25: a module calling it
        if isinstance(f, types.FunctionType) and (f.__module__ == namespace.get("__name__") or f is not v):
            originals[k], leaves[k] = v, f

    def leaf(original):
        def call(*args, **kwargs):
            if _proxy_tracer((args, kwargs)) is tracer and not tracer._executing:
                return tracer.create_proxy("call_function", original, args, kwargs)
            return original(*args, **kwargs)
        return call

    namespace.update({k: leaf(f) for k, f in leaves.items()})
    try:
        yield
    finally:
        namespace.update(originals)


def trace(module: nn.Module, args: tuple = (), kwargs: dict | None = None) -> Traced:
    """Trace `type(module).forward` called with the recorded `args`/`kwargs` (tensors may be meta).

    Never raises for an untraceable forward: the partial graph comes back with
    `Traced.error` set.
    """
    cls = type(module)
    tracer = AllLeafTracer()
    error = None
    with preserved_state(module), attention_as_leaf(), _local_functions_as_leaves(cls, tracer), torch.no_grad():
        try:
            tracer.trace(module, concrete_args=(tuple(args), dict(kwargs or {})))
        except Exception as e:  # noqa: BLE001 - keep the partial graph, say where it stopped
            error = error_location(e, cls)
    return Traced(module=module, graph=tracer.graph, error=error)
