"""Whether a module's forward computes something else in the other mode (train / eval).

A module-scope rewrite (`fxrewrite.patterns.base`, scope "module") replaces the whole module with a fused layer that
computes what the graph traced in the module's current mode computes. A forward that reads ``self.training``
(Mixtral's router jitter: ``if self.training and self.jitter_noise > 0: hidden_states *= noise``) traces without
that branch in eval mode, the mode `from_pretrained` returns a model in; the replacement would then skip it in train
mode too, silently (a wrong rewrite, not a slower one). So before such a replacement the module is traced again
with its own ``training`` flag flipped (its children are leaves: their flags do not change the graph), and the
replacement is refused unless both graphs are the same.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

from torch import nn

from fxrewrite import tracer, user_hooks
from fxrewrite.meta_memo import MetaMemo, memoized, with_parameters


@contextlib.contextmanager
def _flipped(module: nn.Module) -> Iterator[None]:
    """Within: `module.training` (its own flag, not its children's) is the other value; restored on exit."""
    module.training = not module.training
    try:
        yield
    finally:
        module.training = not module.training


def trace(module: nn.Module, args: tuple, kwargs: dict, model: nn.Module, memo: MetaMemo
          ) -> tuple["tracer.Traced", Callable[[], str | None]]:
    """(`tracer.trace` of `module` on its recorded `args` / `kwargs`, its children run on meta through `memo` and
    users' hooks suspended; a function that, when called, traces it again in the other mode: `mode_dependence`)."""
    with memoized(with_parameters(model), memo), user_hooks.suspended(module):  # children run on meta
        traced = tracer.trace(module, args, kwargs)
    return traced, functools.partial(mode_dependence, traced, args, kwargs, model, memo)


def refuse_if_mode_dependent(matches: list, entry, modes: Callable[[], str | None]) -> list:
    """`matches` (module-scope ones) when `modes()` (asked only if there are any) finds no difference between the
    modes; else [] and a skip line in `entry` (a `fxrewrite.report.ClassReport`) for each, with the reason."""
    why = modes() if matches else None
    for m in matches if why else ():
        entry.skip(m.pattern.name, why)
    return [] if why else matches


def mode_dependence(traced: "tracer.Traced", args: tuple, kwargs: dict, model: nn.Module, memo: MetaMemo) -> str | None:
    """None when ``traced.module``'s forward, traced again on the same recorded `args` / `kwargs` with its
    ``training`` flag flipped, gives the same graph and the same trace error as `traced`; else the reason for the
    report. `model` and `memo` are the ones the first trace ran under (children run on meta, memoized)."""
    module = traced.module
    with memoized(with_parameters(model), memo), user_hooks.suspended(module), _flipped(module):
        other = tracer.trace(module, args, kwargs)
    if other.error == traced.error and str(other.graph) == str(traced.graph):
        return None
    now, then = ("train", "eval") if module.training else ("eval", "train")
    return (f"the forward computes something else in {then} mode (it reads self.training; traced in {now} mode): "
            f"a replacement would compute {now} mode's graph in both; left as it is")
