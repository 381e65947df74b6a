"""`optimize`'s options, checked before anything changes: a TypeError names the bad option or value."""

from __future__ import annotations

import reprlib
from typing import Any

from fxrewrite.patterns import PATTERNS, Pattern

OPTIONS = frozenset({"patterns", "example_inputs", "merge_weights"})


def checked(opts: dict[str, Any]) -> tuple[tuple, tuple[tuple, dict] | None, bool]:
    """(pattern classes, example inputs as (args tuple, kwargs dict) or None, merge_weights) from `optimize`'s
    keyword options.

    TypeError for an unknown option, ``patterns`` that is not an iterable of `fxrewrite.patterns.Pattern`
    subclasses (a string such as ``"qkv"`` included), ``example_inputs`` that is not an ``(args, kwargs)`` pair
    of a tuple/list and a dict, or ``merge_weights`` that is not a bool; each message names the value it got.
    """
    unknown = set(opts) - OPTIONS
    if unknown:
        raise TypeError(f"unknown optimize option(s) {sorted(unknown)}; expected one of {sorted(OPTIONS)}")
    merge = opts.get("merge_weights", True)
    if not isinstance(merge, bool):
        raise TypeError(f"optimize(merge_weights=...) expects True or False, got {reprlib.repr(merge)}")
    return _patterns(opts.get("patterns", PATTERNS)), _example_inputs(opts.get("example_inputs")), merge


def _is_pattern(p) -> bool:
    return isinstance(p, Pattern) or (isinstance(p, type) and issubclass(p, Pattern))


def _patterns(patterns) -> tuple:
    items = tuple(patterns) if isinstance(patterns, (tuple, list)) else None  # "qkv" is one bad value, not three
    bad = [p for p in items if not _is_pattern(p)] if items is not None else [patterns]
    if bad:
        raise TypeError("optimize(patterns=...) expects a tuple of fxrewrite.patterns.Pattern subclasses, e.g. "
                        "fxrewrite.patterns.PATTERNS (the default); "
                        f"got {reprlib.repr(bad[0])} ({type(bad[0]).__name__})")
    return items


def _example_inputs(example_inputs) -> tuple[tuple, dict] | None:
    if example_inputs is None:
        return None
    pair = isinstance(example_inputs, (tuple, list)) and len(example_inputs) == 2
    if not (pair and isinstance(example_inputs[0], (tuple, list)) and isinstance(example_inputs[1], dict)):
        raise TypeError("optimize(example_inputs=...) expects (args, kwargs): a tuple of model.forward's positional "
                        "inputs and a dict of its keyword inputs, e.g. ((input_ids,), {}); "
                        f"got {reprlib.repr(example_inputs)}")
    return tuple(example_inputs[0]), dict(example_inputs[1])


_OPTIONS_ATTR = "_fxrewrite_options"


def remember(model, patterns: tuple, merge_weights: bool) -> None:
    """Record the options `optimize` rewrote `model` with (for `check_same_options`)."""
    model.__dict__[_OPTIONS_ATTR] = (patterns, merge_weights)


def check_same_options(model, patterns, merge_weights: bool) -> None:
    """A second `optimize` of a model returns it as it is: ValueError when its options ask for another rewrite
    (merge_weights=False after a merged one, another pattern list), which the model no longer can be given."""
    first = model.__dict__.get(_OPTIONS_ATTR)
    if first is None or (_classes(first[0]), first[1]) == (_classes(patterns), merge_weights):
        return
    was, now = (f"patterns={[getattr(p, '__name__', type(p).__name__) for p in chosen]}, merge_weights={merge}"
                for chosen, merge in (first, (patterns, merge_weights)))
    raise ValueError(f"optimize: this model was already optimized with {was}; asked again with {now}. A rewrite is "
                     "not undone: optimize a freshly loaded model with the options wanted")


def _classes(patterns) -> tuple:
    """The pattern classes of a pattern list (instances by their class: a deep copy makes new ones)."""
    return tuple(p if isinstance(p, type) else type(p) for p in patterns)
