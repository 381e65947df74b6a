"""Optimizer state between a model's Hugging Face parameters and its optimized (fused) parameters.

`optimize` fuses q/k/v and gate/up into one parameter each, so ``model.parameters()`` of the optimized
model is shorter and in another order than the stock model's, and a ``torch.optim`` state dict saved
from one does not load into the other. `optimizer_state_dict(model, state, to="fused" | "hf")` converts:
per-parameter state tensors shaped like the parameter (AdamW's ``exp_avg`` / ``exp_avg_sq``, SGD's
``momentum_buffer``) are concatenated (to "fused") or split (to "hf") along dim 0 in the fused layer's
shard order; other entries (``step``) are copied (the parts of one fused parameter share one value;
to "fused" takes the first part's). Parameter indices follow, per param group, the target model's
``named_parameters()`` order: an optimizer built as ``AdamW(model.parameters())`` (one group) or from
groups listed in that order loads the result. The HF order is the stock model's, recorded by `optimize`.
When the state dict carries ``param_names`` (optimizers built from ``named_parameters()``), those are used
and converted too.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from fxrewrite.weights import HF_NAMES_ATTR, _sizes, shard_map

__all__ = ["optimizer_state_dict", "HF_NAMES_ATTR"]



def _fused_parts(model: nn.Module) -> dict[str, list[str]]:
    """{fused parameter name: [HF names in shard order]}."""
    parts: dict[str, list[tuple[Any, str]]] = {}
    for hf, (fused, sid) in shard_map(model).items():
        parts.setdefault(fused, []).append((sid, hf))
    out = {}
    for fused, items in parts.items():
        order = {"q": 0, "k": 1, "v": 2}
        out[fused] = [hf for _, hf in sorted(items, key=lambda x: order.get(x[0], x[0]))]
    return out


def _names(model: nn.Module, side: str) -> list[str]:
    if side == "fused":
        return [n for n, _ in model.named_parameters()]
    names = model.__dict__.get(HF_NAMES_ATTR)
    if names is None:
        raise ValueError(f"{type(model).__name__} has not been passed through fxrewrite.optimize: no HF parameter order")
    return list(names)


def _group_names(state: dict, names: list[str], side: str = "hf", given: list | None = None) -> list[list[str]]:
    groups, flat = state["param_groups"], iter(names)
    if given is not None and (not isinstance(given, (list, tuple)) or len(given) != len(groups)
                              or any(len(n) != len(g["params"]) for n, g in zip(given, groups))):
        raise ValueError(f"param_names must list each of the state dict's {len(groups)} param groups' parameter "
                         f"names (sizes {[len(g['params']) for g in groups]}), got "
                         f"{[len(n) for n in given] if isinstance(given, (list, tuple)) else given!r}")
    out = []
    for i, g in enumerate(groups):
        if given is not None:
            out.append(list(given[i]))
        elif g.get("param_names") is not None:
            out.append(list(g["param_names"]))
        else:
            try:
                out.append([next(flat) for _ in g["params"]])
            except StopIteration:
                view = "stock model's optimizer (HF view)" if side == "hf" else "optimized model's optimizer (fused view)"
                raise ValueError(f"the state dict lists more parameters than the model's {side} view has "
                                 f"({len(names)}); this conversion reads a state dict of the {view}") from None
    return out


def optimizer_state_dict(model: nn.Module, state_dict: dict, *, to: str,
                         param_names: list[list[str]] | None = None) -> dict:
    """Convert ``optimizer.state_dict()`` between the HF view (``to="fused"`` reads an HF-order state) and
    the optimized model's view (``to="hf"`` reads a fused-order state). Returns a new dict; the input
    is not modified. ``param_names``: per param group, the names (in the source view) of its parameters, for a
    state dict saved without them from groups not in ``named_parameters()`` order (transformers.Trainer's
    weight-decay groups: README, "Optimizer state"). ValueError for an unknown ``to``, a model not passed through
    `optimize`, ``param_names`` that do not match the groups' sizes, or a state dict listing parameters the
    model does not have.
    """
    if to not in ("fused", "hf"):
        raise ValueError(f"to={to!r}; expected 'fused' or 'hf'")
    src_side = "hf" if to == "fused" else "fused"
    parts = _fused_parts(model)
    owner = {hf: fused for fused, hfs in parts.items() for hf in hfs}
    sizes = {name: _sizes(model.get_submodule(name.rpartition(".")[0])) for name in parts}
    target_order = _names(model, to)
    src_groups = _group_names(state_dict, _names(model, src_side), src_side, param_names)
    by_name = {}
    index = 0
    for names in src_groups:
        for name in names:
            if index in state_dict["state"]:
                by_name[name] = state_dict["state"][index]
            index += 1
    unnamed = 0 if param_names is not None else sum(g.get("param_names") is None for g in state_dict["param_groups"])
    if to == "fused" and not unnamed:  # names known (unnamed groups: the shape check below explains them)
        _check_parts_grouped(src_groups, owner)
    _check_shapes(by_name, _param_shapes(model, src_side, parts, owner, sizes), src_side, to, unnamed)
    out = {"state": {}, "param_groups": []}
    new_index = 0
    for group, names in zip(state_dict["param_groups"], src_groups):
        if to == "fused":
            wanted = {owner.get(n, n) for n in names}
        else:
            wanted = {h for n in names for h in parts.get(n, [n])}
        missing = wanted - set(target_order)
        if missing:
            raise ValueError(f"state dict names parameters the model does not have: {sorted(missing)[:5]}")
        ordered = [n for n in target_order if n in wanted]
        new_group = {k: copy.deepcopy(v) for k, v in group.items() if k not in ("params", "param_names")}
        new_group["params"] = list(range(new_index, new_index + len(ordered)))
        if group.get("param_names") is not None:
            new_group["param_names"] = ordered
        for name in ordered:
            entry = _convert_entry(name, to, by_name, parts, owner, sizes)
            if entry is not None:
                out["state"][new_index] = entry
            new_index += 1
        out["param_groups"].append(new_group)
    return out


def _check_parts_grouped(groups: list[list[str]], owner: dict[str, str]) -> None:
    """ValueError naming the fused parameter whose parts (q / k / v, gate / up) sit in different param groups: one
    fused parameter can have one group's settings only."""
    group_of: dict[str, tuple[int, str]] = {}
    for i, names in enumerate(groups):
        for name in names:
            fused = owner.get(name)
            if fused is None:
                continue
            first = group_of.setdefault(fused, (i, name))
            if first[0] != i:
                raise ValueError(f"{first[1]!r} (param group {first[0]}) and {name!r} (param group {i}) are parts of "
                                 f"the optimized model's {fused!r}, one parameter: put its parts in one group")


def _param_shapes(model: nn.Module, side: str, parts: dict, owner: dict, sizes: dict) -> dict[str, tuple]:
    """{name: shape} of the model's parameters in the ``side`` view (an HF part: its rows of the fused one)."""
    params = dict(model.named_parameters())
    if side == "fused":
        return {name: tuple(p.shape) for name, p in params.items()}
    shapes = {}
    for name in _names(model, "hf"):
        fused = owner.get(name)
        if fused is None:
            shapes[name] = tuple(params[name].shape) if name in params else None
        else:
            rows = sizes[fused][parts[fused].index(name)]
            shapes[name] = (rows, *params[fused].shape[1:])
    return shapes


def _check_shapes(by_name: dict, shapes: dict, side: str, to: str, unnamed_groups: int) -> None:
    """ValueError naming the first state tensor shaped unlike its parameter: a state dict of the other view (``to``
    names the view wanted, the input must be the other one), or, with several groups that carry no
    ``param_names``, groups whose parameters are not in `named_parameters()` order (weight-decay groups)."""
    groups = (f"; or its {unnamed_groups} param groups do not list the parameters in named_parameters() order "
              "(weight-decay groups, say): pass param_names (each group's names), or build the optimizer from "
              "model.named_parameters() so its state dict names them") if unnamed_groups > 1 else ""
    for name, entry in by_name.items():
        want = shapes.get(name)
        for key, value in (entry or {}).items():
            if want is not None and torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != want:
                raise ValueError(f"state of {name!r}: {key} has shape {tuple(value.shape)}, the parameter {want}; "
                                 f"to={to!r} reads a state dict of the {side} view (the "
                                 f"{'stock' if side == 'hf' else 'optimized'} model's optimizer){groups}")


def _cloned(entry):
    """A copy of one parameter's state whose tensors share nothing with the input (no aliasing)."""
    return None if entry is None else {k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in entry.items()}


def _convert_entry(name, to, by_name, parts, owner, sizes):
    if to == "fused":
        if name not in parts:
            return _cloned(by_name.get(name))
        pieces = [by_name.get(h) for h in parts[name]]
        if any(p is None for p in pieces):
            return None
        merged = {}
        for key, value in pieces[0].items():
            if torch.is_tensor(value) and value.dim() > 0:
                merged[key] = torch.cat([p[key] for p in pieces], dim=0)
            else:
                merged[key] = value.clone() if torch.is_tensor(value) else copy.deepcopy(value)
        return merged
    fused = owner.get(name)
    if fused is None:
        return _cloned(by_name.get(name))
    entry = by_name.get(fused)
    if entry is None:
        return None
    i = parts[fused].index(name)
    return {k: (v.split(sizes[fused], dim=0)[i].clone() if torch.is_tensor(v) and v.dim() > 0 else _cloned({k: v})[k])
            for k, v in entry.items()}
