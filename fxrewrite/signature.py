"""Structure signatures: which module instances may share one trace, one match and one meta run.

Two instances of a class get the same `structure_key` only when everything their forward can see is the same:
the class; the forward itself (an instance-level ``forward``, a monkey patch or anything not ours, makes the
key unique to that instance; a forward fxrewrite bound counts as the compiled function it runs); forward /
backward hooks anywhere in the subtree (any hook makes the key unique); every parameter's and buffer's name,
class, shape, dtype, device and ``requires_grad``; every other attribute, by value for plain Python values
(numbers, strings, flags, dtypes, nested tuples / lists / dicts of them) and by identity for anything else
(a config object, a function, a tensor kept as a plain attribute); and the children's names and keys,
recursively. So a LoRA wrapper on one layer's ``q_proj``, a sliding-window attention (its ``sliding_window``
/ ``layer_type`` attributes), a different child class or shape all separate instances.

Two exceptions, checked and not assumed: transformers gives every decoder layer its index (``layer_idx``) for
the KV cache only; it is left out of the key when no method of the class but ``__init__`` uses
``self.layer_idx`` except as a call argument or a subscript (``cache.update(k, v, self.layer_idx)``,
``cache.layers[self.layer_idx]``). Any other use (a comparison, arithmetic, ``getattr``) keeps it in the key.
The meta run and the traces pass no cache, so those uses do not run. And PEFT's LoRA layers keep their
constructor's arguments as ``self.kwargs``, the module's own name (``target_name``) among them, so every
wrapped projection would be an instance of its own (one trace per layer, one report line per layer); a
`RECORD_ATTRS` attribute is left out of the key when no method of the class but ``__init__`` names it at all.

`input_key` is the same idea for a call's arguments: tensors by class, shape, strides, dtype, device and
``requires_grad``, plain values by value, anything else by identity.
"""

from __future__ import annotations

import ast
import enum
import functools
import inspect
import textwrap
import types
from typing import Hashable

import torch
from torch import nn

from fxrewrite import hub_kernels

__all__ = ["BOUND_ATTR", "BOUND_ATTRS", "HOOK_DICTS", "MEMO_ATTR", "SOURCE_ACT_ATTR", "difference", "input_key",
           "instance_forward", "structure_key", "structure_keys"]

BOUND_ATTR = "_fxrewrite_compiled"
"""Instance attribute set by `fxrewrite.compiler`: (compiled function, the bound forward it put in ``__dict__``)."""
MEMO_ATTR = "__fxrewrite_wrapped__"
"""Attribute of `fxrewrite.meta_memo`'s forward wrappers: the forward they wrap (ignored here)."""

INDEX_ATTRS = ("layer_idx",)
RECORD_ATTRS = ("kwargs",)
"""Attributes that record how a module was built (PEFT's LoRA layers): ignored when only ``__init__`` names them."""
SOURCE_ACT_ATTR = "_fxrewrite_source_act"
"""Instance attribute (not a registered child) of a gated activation the rewrite built in place of an MLP's
activation module (`fxrewrite.layers.activation`): that module, still the MLP's registered child, so it is keyed
there and left out of the activation's key (by identity it would make every layer's key its own)."""
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
BOUND_ATTRS = ("forward", "_replicate_for_data_parallel", "__reduce_ex__", BOUND_ATTR)
"""The instance attributes ``fxrewrite.bound_forward.bind`` sets."""
_SKIP = frozenset({"_parameters", "_buffers", "_modules", SOURCE_ACT_ATTR, *BOUND_ATTRS, *HOOK_DICTS,
                   "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
                   "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                   "_load_state_dict_post_hooks", "_is_full_backward_hook"})
_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size, enum.Enum)


def structure_key(module: nn.Module) -> Hashable:
    """A hashable key, equal for two instances only when their forwards see the same structure (module doc)."""
    return _key(module, {})


def structure_keys(root: nn.Module) -> dict[int, Hashable]:
    """{id(module): structure_key(module)} for every module under `root`, in one pass when no module is reached
    twice (children's keys are reused), else module by module."""
    everything = list(root.modules(remove_duplicate=False))
    if len({id(m) for m in everything}) != len(everything):
        return {id(m): structure_key(m) for m in everything}
    done: dict[int, Hashable] = {}
    for module in reversed(everything):  # children before parents
        done[id(module)] = _key(module, {}, done)
    return done


def _key(module: nn.Module, seen: dict, done: dict | None = None) -> Hashable:
    if done is not None and id(module) in done:  # `structure_keys`: no sharing, children first
        return done[id(module)]
    if id(module) in seen:  # a child shared twice in one subtree
        return ("shared", seen[id(module)])
    seen[id(module)] = len(seen)
    d = module.__dict__
    own, bound = instance_forward(module), d.get(BOUND_ATTR)
    if any(d.get(h) for h in HOOK_DICTS) or (own is not None and (bound is None or own is not bound[1])):
        return ("unique", id(module))  # hooks, or a forward replaced on this instance by someone else
    forward = None if own is None else ("bound", id(bound[0]))
    params = tuple((n, None if p is None else _tensor_key(p)) for n, p in module._parameters.items())
    buffers = tuple((n, None if b is None else _tensor_key(b)) for n, b in module._buffers.items())
    labels = _index_labels(type(module))
    attrs = tuple((k, _value_key(v)) for k, v in d.items() if _kept(k, v, labels))
    children = tuple((n, None if c is None else _key(c, seen, done)) for n, c in module._modules.items())
    return (type(module), forward, params, buffers, attrs, children)


def children_differing(a: nn.Module, b: nn.Module) -> int:
    """How many direct children of `a` and `b` differ in `structure_key` (one missing on a side counts): the
    nearer of two groups to compare a third with (`difference` names only the first thing that differs)."""
    names = dict.fromkeys([*a._modules, *b._modules])
    return sum((a._modules.get(n) is None) != (b._modules.get(n) is None)
               or (a._modules.get(n) is not None and _key(a._modules[n], {}) != _key(b._modules[n], {}))
               for n in names)


def difference(a: nn.Module, b: nn.Module, path: str = "") -> str:
    """The first thing (depth first) that makes `structure_key` of `b` differ from `a`'s, in words."""
    where = path or "the module"
    hooked = [any(m.__dict__.get(h) for h in HOOK_DICTS) for m in (a, b)]
    if hooked[1] and not hooked[0]:  # first: hooks also keep a module from being replaced (another type then)
        return f"{where} has forward/backward hooks"
    if type(a) is not type(b):
        na, nb = type(a).__name__, type(b).__name__
        if na == nb:
            na, nb = (f"{type(m).__module__}.{type(m).__qualname__}" for m in (a, b))
        return f"{where} is {nb}, not {na}"
    ka, kb = _key(a, {}), _key(b, {})
    if any(b.__dict__.get(h) for h in HOOK_DICTS):
        return f"{where} has forward/backward hooks"
    if kb[0] == "unique":
        return f"{where} has a forward replaced on the instance"
    if ka[0] == "unique":
        return f"{where} has no hooks or replaced forward, unlike the other"
    if ka[1] != kb[1]:
        return f"{where} runs another forward (rewritten differently)"
    for kind in ("_parameters", "_buffers"):
        pa, pb = getattr(a, kind), getattr(b, kind)
        for name in dict.fromkeys([*pa, *pb]):
            ka, kb = (None if t is None else _tensor_key(t)[1:] for t in (pa.get(name), pb.get(name)))
            if ka != kb:
                return f"{where}: {name} (shape, dtype, device, requires_grad) {kb} instead of {ka}"
    for name in dict.fromkeys([*a._modules, *b._modules]):
        ca, cb = a._modules.get(name), b._modules.get(name)
        if (ca is None) != (cb is None):
            return f"{path + '.' if path else ''}{name} is {'missing' if cb is None else 'added'}"
        if ca is not None and _key(ca, {}) != _key(cb, {}):
            return difference(ca, cb, f"{path + '.' if path else ''}{name}")
    labels = _index_labels(type(a))
    va, vb = ({k: v for k, v in m.__dict__.items() if _kept(k, v, labels)} for m in (a, b))
    for name in dict.fromkeys([*va, *vb]):
        if _value_key(va.get(name)) != _value_key(vb.get(name)):
            return f"{where}: attribute {name} = {_short(vb.get(name))} instead of {_short(va.get(name))}"
    return "the inputs of its recorded call differ (shapes, dtypes or values)"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def instance_forward(module: nn.Module):
    """The instance-level ``forward`` of `module` (None when it runs its class's), seen through the meta memo."""
    own = module.__dict__.get("forward")
    return getattr(own, MEMO_ATTR) if hasattr(own, MEMO_ATTR) else own


def _tensor_key(t: torch.Tensor) -> tuple:
    return (type(t), tuple(t.shape), t.dtype, t.device, t.requires_grad)


def _value_key(v) -> Hashable:
    if isinstance(v, _PLAIN):
        return (type(v), v)
    if isinstance(v, (tuple, list, frozenset, set)):
        items = sorted(map(_value_key, v), key=repr) if isinstance(v, (set, frozenset)) else map(_value_key, v)
        return (type(v), tuple(items))
    if type(v) is dict:
        return (dict, tuple((_value_key(k), _value_key(x)) for k, x in v.items()))
    if type(v) is functools.partial:  # transformers' activations keep one per instance (gelu, approximate=...)
        return (functools.partial, ("id", id(v.func)), _value_key(v.args), _value_key(v.keywords))
    if hub_kernels.pristine(v):  # transformers >= 5.25: each attention's private copy of a function, unchanged
        return ("hub function", type(v), id(hub_kernels.decorated_function(v)))
    return ("id", id(v))


def input_key(args: tuple, kwargs: dict) -> Hashable:
    """Key of a call's arguments: tensors by metadata, plain values by value, other objects by identity."""
    def one(a):
        if isinstance(a, torch.Tensor):
            return (type(a), tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad)
        if isinstance(a, (tuple, list)):
            return (type(a), tuple(one(x) for x in a))
        if type(a) is dict:
            return (dict, tuple((k, one(x)) for k, x in a.items()))
        return (type(a), a) if isinstance(a, _PLAIN) else ("id", id(a))
    return (one(tuple(args)), one(dict(kwargs)))


def _kept(name: str, value, ignored: frozenset[str]) -> bool:
    """Whether instance attribute `name` counts in the key (`ignored`: `_index_labels` of the class)."""
    return name not in _SKIP and not (name in ignored and (type(value) is int or name in RECORD_ATTRS))


@functools.lru_cache(maxsize=None)
def _index_labels(cls: type) -> frozenset[str]:
    """The `INDEX_ATTRS` that `cls` only passes on (call argument, subscript) outside ``__init__``, and the
    `RECORD_ATTRS` that it never names there."""
    return frozenset([*(name for name in INDEX_ATTRS if _only_passed_on(cls, name)),
                      *(name for name in RECORD_ATTRS if _only_passed_on(cls, name, never=True))])


def _only_passed_on(cls: type, name: str, never: bool = False) -> bool:
    """No method of `cls` but ``__init__`` uses ``<x>.<name>`` other than as a call argument or subscript
    (never: names it at all)."""
    for klass in cls.__mro__:
        for attr, value in vars(klass).items():
            if attr == "__init__":
                continue
            for fn in _functions(value):
                if not _mentions(fn.__code__, name):
                    continue  # cheap: the name is not in the bytecode at all
                if never:
                    return False
                try:
                    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
                except (OSError, TypeError, SyntaxError):
                    return False  # source unknown: the attribute stays in the key
                if not _uses_ok(tree, name):
                    return False
    return True


def _functions(value) -> list[types.FunctionType]:
    """The plain functions behind a class attribute (methods, static/class methods, properties), unwrapped."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    found = [value.fget, value.fset, value.fdel] if isinstance(value, property) else [value]
    out = []
    for fn in found:
        fn = inspect.unwrap(fn) if isinstance(fn, types.FunctionType) else fn
        if isinstance(fn, types.FunctionType):
            out.append(fn)
    return out


def _mentions(code: types.CodeType, name: str) -> bool:
    return name in code.co_names or name in code.co_consts or any(
        _mentions(c, name) for c in code.co_consts if isinstance(c, types.CodeType))


def _uses_ok(fn: ast.AST, name: str) -> bool:
    """Every ``<x>.<name>`` in `fn` is a call argument or a subscript index, and no string spells `name`."""
    allowed = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            allowed.update(id(a) for a in node.args)
            allowed.update(id(k.value) for k in node.keywords)
        elif isinstance(node, ast.Subscript):
            allowed.add(id(node.slice))
    for node in ast.walk(fn):
        if isinstance(node, ast.Constant) and node.value == name:
            return False  # getattr(self, "layer_idx") and the like
        if isinstance(node, ast.Attribute) and node.attr == name and id(node) not in allowed:
            return False
    return True
