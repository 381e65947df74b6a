"""A rewritten ``forward`` made the forward of one instance, and kept so by what copies modules.

:func:`bind` sets the instance attribute ``forward`` (the class and its other instances keep their own), and two
more that keep it right where a module is copied without its class knowing:

- ``nn.DataParallel`` (transformers' Trainer wraps a model in it when it sees several GPUs and no launcher) copies
  each module's ``__dict__`` into a replica, forward included, still bound to the original (the first device's
  weights); the instance's ``_replicate_for_data_parallel`` binds it to the replica.
- ``pickle`` (``torch.save(model)``, a model passed to a spawned process) stores a bound method as "look up
  ``forward`` on the object", which would find the class's, and cannot store the compiled function at all; the
  instance's ``__reduce_ex__`` stores a :class:`ForwardRecipe` instead (the edited source and where it came from),
  and unpickling compiles it again in the modeling module's namespace. ``copy.deepcopy`` takes the same path and
  gets the same function object back (compiled once per recipe in a process).
"""

from __future__ import annotations

import copyreg
import dataclasses
import functools
import importlib
import textwrap
import types

from torch import nn

from fxrewrite.signature import BOUND_ATTR, BOUND_ATTRS

__all__ = ["ForwardRecipe", "bind", "keep_checkpointing", "remember"]

@dataclasses.dataclass(frozen=True)
class ForwardRecipe:
    """What compiles an edited ``forward`` again: the class defining the original (for zero-argument ``super()``),
    its file and first line (tracebacks point at the real file), the name of the module whose globals it reads, the
    function's name and the edited source (dedented, decorators included)."""

    cls: type
    filename: str
    first_lineno: int
    module: str
    name: str
    code: str

    def compile(self, namespace: dict | None = None) -> types.FunctionType:
        """The function, compiled in `namespace` (default: the globals of the module named ``module``, imported).

        Line numbers are offset so that tracebacks point at the real file; the function is defined inside a factory
        taking ``__class__`` so zero-argument ``super()`` still works; decorators in the source are applied again, as
        in the original class body. ImportError when the module cannot be imported."""
        if namespace is None:
            try:
                namespace = importlib.import_module(self.module).__dict__
            except ImportError as e:
                raise ImportError(f"cannot compile the rewritten {self.cls.__qualname__}.{self.name} again (a pickled "
                                  f"optimized model): its module {self.module!r} does not import here: {e}") from e
        header = "\n" * max(self.first_lineno - 2, 0) + "def __fxrewrite_factory__(__class__):\n"
        code = header + textwrap.indent(self.code, "    ") + f"\n    return {self.name}\n"
        local: dict = {}
        exec(compile(code, self.filename, "exec"), namespace, local)  # noqa: S102 - our own edited source
        fn = local["__fxrewrite_factory__"](self.cls)
        fn.__fxrewrite_source__ = self.code
        fn.__fxrewrite_recipe__ = self
        return fn


_COMPILED: dict[ForwardRecipe, types.FunctionType] = {}


def remember(recipe: ForwardRecipe, fn: types.FunctionType) -> types.FunctionType:
    """`fn` (compiled from `recipe`) is the one a copy made from this recipe in this process gets; returns `fn`."""
    return _COMPILED.setdefault(recipe, fn)


def _compiled(recipe: ForwardRecipe) -> types.FunctionType:
    fn = _COMPILED.get(recipe)
    return fn if fn is not None else remember(recipe, recipe.compile())


def bind(module: nn.Module, fn: types.FunctionType) -> None:
    """Make `fn` (from :meth:`ForwardRecipe.compile`) the forward of this instance only, inside the class's activation
    checkpointing wrapper when it has one (:func:`keep_checkpointing`); its nn.DataParallel replicas and its pickled
    copies keep it (see the module docstring). ``module.__dict__[BOUND_ATTR]`` = (fn, the bound forward). Written to
    ``__dict__`` directly: unpickling binds an instance whose state is not set yet."""
    forward = types.MethodType(keep_checkpointing(type(module).forward, fn), module)
    module.__dict__.update({
        "forward": forward,
        "_replicate_for_data_parallel": types.MethodType(_replicate_rebound, module),
        "__reduce_ex__": types.MethodType(_reduce_ex, module),
        BOUND_ATTR: (fn, forward),
    })


def _replicate_rebound(self: nn.Module) -> nn.Module:
    """``nn.Module._replicate_for_data_parallel`` (a copy of ``__dict__``) with the forward bound to the replica."""
    replica = type(self)._replicate_for_data_parallel(self)
    bind(replica, self.__dict__[BOUND_ATTR][0])
    return replica


def _reduce_ex(self: nn.Module, protocol: int):
    """Pickle (and deepcopy) this module as its class would, except for the attributes :func:`bind` set: each is
    stored as "bind the function compiled from this recipe to the new instance, take this attribute"."""
    recipe = self.__dict__[BOUND_ATTR][0].__fxrewrite_recipe__
    state = dict(self.__getstate__())
    for attr in BOUND_ATTRS:
        state[attr] = _Rebound(self, recipe, attr)
    return copyreg.__newobj__, (type(self),), state


class _Rebound:
    """Pickles as :func:`_rebound` (module, recipe, attr): the module is the new instance by then (pickle and deepcopy
    create it before its state), empty until its state, which holds the result, is set."""

    def __init__(self, module: nn.Module, recipe: ForwardRecipe, attr: str):
        self.args = (module, recipe, attr)

    def __reduce__(self):
        return _rebound, self.args


def _rebound(module: nn.Module, recipe: ForwardRecipe, attr: str):
    if BOUND_ATTR not in module.__dict__:
        bind(module, _compiled(recipe))
    return module.__dict__[attr]


def keep_checkpointing(class_forward, fn: types.FunctionType) -> types.FunctionType:
    """``fn`` wrapped as ``class_forward`` wraps the class's own forward, when that is transformers'
    activation-checkpointing wrapper; else ``fn``. Newer transformers 5.x wrap ``forward`` of every
    ``GradientCheckpointingLayer`` subclass at class creation (``forward_with_checkpointing``, closing over
    ``forward``) instead of checkpointing in ``__call__``, so a bare instance forward would silently turn
    activation checkpointing off. The wrapper's own code is reused with ``forward`` rebound to ``fn`` (its
    "outermost" test still sees the class's wrapper): the same checkpointing, cache handling and warnings."""
    code = getattr(class_forward, "__code__", None)
    if code is None or code.co_name != "forward_with_checkpointing" or \
            set(code.co_freevars) != {"forward", "forward_with_checkpointing"}:
        return fn
    cells = {"forward": types.CellType(fn), "forward_with_checkpointing": types.CellType(class_forward)}
    wrapped = types.FunctionType(code, class_forward.__globals__, code.co_name, class_forward.__defaults__,
                                 tuple(cells[name] for name in code.co_freevars))
    return functools.update_wrapper(wrapped, fn)
