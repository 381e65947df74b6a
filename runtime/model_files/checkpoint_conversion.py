"""Checkpoint layouts -> the model's names, through transformers' own conversion rules.

transformers 5 stores each MoE layer's experts as two 3-D tensors (``experts.gate_up_proj``
[E, 2I, H], ``experts.down_proj`` [E, H, I]) while hub checkpoints, and ``save_pretrained``,
hold one tensor per expert (``experts.N.gate_proj.weight``..., Mixtral's ``w1/w2/w3`` under
``block_sparse_moe``). `from_pretrained` converts with the rules in
``transformers.conversion_mapping`` (``WeightRenaming`` / ``WeightConverter``); `convert_checkpoint`
applies the same rules to a stream of (name, tensor) pairs, so the engine's loader needs no second
copy of them. A converter's group (all experts of one layer) is emitted as soon as it is complete
(one tensor per expert for each of its source patterns), so at most a layer's experts are held.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Iterator

import torch
from accelerate import init_empty_weights
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key

from fxrewrite.errors import UserInputError


def transforms_for(model=None, model_type: str | None = None) -> list:
    """transformers' transforms for a `PreTrainedModel` (scoped to its sub-models), else for `model_type`."""
    if model is not None and hasattr(model, "config") and hasattr(model, "base_model_prefix"):
        return get_model_conversion_mapping(model)
    return (get_checkpoint_conversion_mapping(model_type) or []) if model_type else []


class _Group:
    """The source tensors of one converter target (e.g. one layer's gate and up projections)."""

    def __init__(self, converter: WeightConverter) -> None:
        self.converter = copy.deepcopy(converter)
        self.sources: dict[str, list[tuple[str, torch.Tensor]]] = {p: [] for p in converter.source_patterns}

    def add(self, pattern: str, name: str, tensor) -> None:
        self.sources[pattern].append((name, tensor))

    def complete(self, expected: int | None) -> bool:
        return expected is not None and all(len(v) == expected for v in self.sources.values())

    def convert(self, target: str, model=None) -> dict[str, torch.Tensor]:
        for pattern, items in self.sources.items():
            for name, tensor in sorted(items, key=lambda kv: dot_natural_key(kv[0])):  # experts in index order
                self.converter.add_tensor(target, name, pattern, tensor)
        out = self.converter.convert(target, model=model, config=getattr(model, "config", None))
        return {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}


def convert_checkpoint(weights: Iterable[tuple[str, torch.Tensor]], transforms: list,
                       expected_count: Callable[[str], int | None] = lambda target: None, model=None,
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) -> (model name, tensor), applying transformers' `transforms`.

    Renamings apply to every name in order, then at most one converter, as in transformers'
    loading. Names no converter claims pass straight through (renamed). A converter target is
    emitted once each of its source patterns has `expected_count(target)` tensors (the expert
    count; None: at the end). Already-converted checkpoints (fused 3-D tensors) pass unchanged.
    `model`: what the converters' operations read parameter shapes and the config from (`StockShapes`: transformers'
    `Split` of a fused ``query_key_value`` into q / k / v sizes each piece by its parameter).
    """
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    pending: dict[str, _Group] = {}
    for name, tensor in weights:
        new, converter, target, pattern = _claim(name, renamings, converters)
        if converter is None:
            yield new, tensor
            continue
        group = pending.setdefault(target, _Group(converter))
        group.add(pattern, name, tensor)
        if group.complete(expected_count(target)):
            yield from pending.pop(target).convert(target, model).items()
    for target, group in pending.items():
        yield from group.convert(target, model).items()


def _claim(name: str, renamings: list, converters: list) -> tuple[str, WeightConverter | None, str, str | None]:
    """(the renamed name, the converter claiming it or None, its target, the source pattern matched), as transformers'
    loading resolves a checkpoint name: every renaming in order, then the first converter whose pattern matches."""
    for renaming in renamings:
        name, _ = renaming.rename_source_key(name)
    for converter in converters:
        target, pattern = converter.rename_source_key(name)
        if pattern is not None:
            return name, converter, target, pattern
    return name, None, name, None


def convert_for_model(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], native: bool
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """`convert_checkpoint` for an engine model: the wrapped HF model's transforms (names relative to
    it), or a native model's ``model_type``'s; a converter target is complete at its module's
    ``global_num_experts`` or ``num_experts`` (else the target parameter's leading dim)."""
    root = model if native else model.hf_model
    transforms = transforms_for(model_type=getattr(model, "model_type", None)) if native else transforms_for(root)
    if not transforms:
        return iter(weights)
    params = dict(root.named_parameters())

    def expected(target: str) -> int | None:
        owner, _, _ = target.rpartition(".")
        try:
            module = root.get_submodule(owner)
        except AttributeError:
            module = None
        # a TP rank's transformers experts module: num_experts is the rank's, the checkpoint holds them all
        count = getattr(module, "global_num_experts", getattr(module, "num_experts", None))
        return count if isinstance(count, int) else (params[target].shape[0] if target in params else None)

    return convert_checkpoint(weights, transforms, expected, None if native else StockShapes(root))


def renamed_keys(model: torch.nn.Module, keys: list[str], native: bool) -> list[str]:
    """`keys` as transformers' renamings for the engine model (`convert_for_model`'s transforms) leave them: a VLM's
    legacy ``language_model.model.*`` becomes ``model.language_model.*`` (converters, which merge tensors, aside)."""
    root = model if native else model.hf_model
    transforms = transforms_for(model_type=getattr(model, "model_type", None)) if native else transforms_for(root)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    return [_claim(k, renamings, [])[0] for k in keys]


class StockShapes:
    """The stock model's parameters, built on meta at the first `get_parameter` (the model the engine loads into may be
    fused by optimize, or sharded by tensor parallelism, while the checkpoint holds whole, unfused tensors)."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        self.cls, self.config = type(hf_model), hf_model.config
        # the dtype the engine loads in: operations that read a parameter's dtype (MXFP4 dequantization) produce it
        self.dtype = next((p.dtype for p in hf_model.parameters() if p.is_floating_point()), None)
        self.model: torch.nn.Module | None = None

    def get_parameter(self, name: str) -> torch.nn.Parameter:
        if self.model is None:
            with init_empty_weights():
                self.model = self.cls(self.config)
            if self.dtype is not None:
                self.model.to(self.dtype)
        return self.model.get_parameter(name)


def checkpoint_layout_to_model(pairs: list[tuple[str, torch.Tensor]], model_type: str | None,
                               num_experts: int | None) -> list[tuple[str, torch.Tensor]]:
    """Weight-sync pairs in a checkpoint's per-expert layout (``mlp.experts.3.gate_proj.weight``, Mixtral's
    ``block_sparse_moe.experts.3.w1.weight``) -> the model's fused 3-D expert tensors, by transformers' rules for
    `model_type` (`convert_checkpoint`: its renamings apply to every name then). Returned unchanged when no
    converter claims any name (the model's own or the engine's fused names).
    Raises UserInputError, before anything is stacked, unless each layer's tensors are experts 0 .. `num_experts` - 1
    exactly once for each source (all of a layer's experts come in one call, strict or not: they are stacked into one
    tensor), all of one shape."""
    transforms = transforms_for(model_type=model_type)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    groups: dict[str, tuple[WeightConverter, list]] = {}
    for name, tensor in pairs:
        renamed, converter, target, pattern = _claim(name, renamings, converters)
        if converter is not None:
            index = re.search(re.escape(pattern).replace(r"\*", r"([^.]+)"), renamed)
            groups.setdefault(target, (converter, []))[1].append(
                (name, pattern, index.group(1) if index else "?", tuple(tensor.shape)))
    if not groups:
        return pairs
    for target, (converter, entries) in groups.items():
        _check_experts(target, converter.source_patterns, entries, num_experts)
    return list(convert_checkpoint(pairs, transforms))


def _check_experts(target: str, patterns: list[str], entries: list, num_experts: int | None) -> None:
    """UserInputError naming the tensor: an expert index outside [0, num_experts), one given twice, one missing, or a
    shape unlike the other experts' of its source or the other sources' (gate and up) of its target."""
    seen: dict[tuple[str, str], str] = {}
    shapes: dict[str, tuple[str, tuple]] = {}
    for name, pattern, index, shape in entries:
        if not index.isdigit() or (num_experts is not None and int(index) >= num_experts):
            raise UserInputError(f"load_weights: tensor {name!r}: expert index {index} is out of range for "
                                 f"num_experts={num_experts} (expected 0 .. {(num_experts or 1) - 1})")
        if (pattern, index) in seen:
            raise UserInputError(f"load_weights: tensors {seen[pattern, index]!r} and {name!r} are both expert "
                                 f"{index} of {target!r}; expected each expert once")
        seen[pattern, index] = name
        first = shapes.setdefault(pattern, (name, shape))
        if shape != first[1]:
            raise UserInputError(f"load_weights: tensor {name!r} has shape {shape}, expert tensor {first[0]!r} "
                                 f"{first[1]}; expected one shape for every expert of {target!r}")
    (name0, shape0), *others = shapes.values()
    for name, shape in others:  # gate and up are stacked side by side: one shape (else torch.cat's own error)
        if shape != shape0:
            raise UserInputError(f"load_weights: tensor {name!r} has shape {shape}, tensor {name0!r} {shape0}; "
                                 f"expected one shape for the projections stacked into {target!r}")
    for pattern in patterns if num_experts is not None else ():
        missing = [e for e in range(num_experts) if (pattern, str(e)) not in seen]
        if missing:
            raise UserInputError(
                f"load_weights: {target!r} is missing expert(s) {missing[:8]} of {pattern!r}; expected all "
                f"{num_experts} experts of each of {patterns} in one call, also with strict=False (they are stacked "
                "into one tensor)")
