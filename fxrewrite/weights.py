"""Weights in Hugging Face names for fused models.

Fused parameters (``qkv_proj.weight``, ``gate_up_proj.weight``...) map back to the original
ones through each pattern's `shards`, recorded on the rewritten module as
``_fxrewrite_shards = [(new_child, [(old_child, shard_id), ...]), ...]``. From that one table:
- `install_hf_name_hooks` makes ``model.state_dict()`` split fused tensors into the HF names
  (so ``save_pretrained`` output loads into a stock model) and ``load_state_dict`` merge HF
  tensors into fused ones (so stock checkpoints load into the optimized model);
- `load_hf_weights` loads an iterable of (HF name, tensor) through each parameter's
  ``weight_loader`` (q/k/v and gate/up as shards), as the serving engine's loader does.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable

import torch
from torch import nn

from fxrewrite.errors import FusedAwayError, UserInputError
from fxrewrite.layers.hook_warning import WarnsOnHooks

SHARDS_ATTR = "_fxrewrite_shards"
_HOOKED = "_fxrewrite_hf_hooks"
_ORDERED = "_fxrewrite_stock_order_hook"


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _sizes(fused: nn.Module) -> list[int]:
    return list(getattr(fused, "output_sizes_per_partition", None) or fused.output_sizes)


def shard_map(model: nn.Module) -> dict[str, tuple[str, Any]]:
    """{HF parameter name: (fused parameter name, shard id)} over the whole model."""
    out: dict[str, tuple[str, Any]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for new, olds in module.__dict__.get(SHARDS_ATTR, ()):
            fused = module.get_submodule(new)
            for pname, _ in fused.named_parameters(recurse=False):
                for old, sid in olds:
                    out[_join(prefix, old, pname)] = (_join(prefix, new, pname), sid)
    return out


def _split_hook(module, state_dict, prefix, local_metadata) -> None:
    for new, olds in module.__dict__.get(SHARDS_ATTR, ()):
        sizes = _sizes(module.get_submodule(new))
        for pname in ("weight", "bias"):
            key = f"{prefix}{new}.{pname}"
            if key in state_dict:
                parts = state_dict.pop(key).split(sizes, dim=0)
                for (old, _), part in zip(olds, parts):
                    state_dict[f"{prefix}{old}.{pname}"] = own_storage(part)


def own_storage(part: torch.Tensor) -> torch.Tensor:
    """`part` (rows of a fused parameter, detached) as a tensor with a storage of its own over the same memory: no
    copy, writes still reach the parameter, as a state dict's views do. Checkpoint writers that group a state dict's
    tensors by storage to drop tied duplicates (accelerate's `Accelerator.save_model`, safetensors' `save_model`)
    would otherwise take q, k and v (gate and up) for one shared tensor and keep only q (or refuse). A tensor that
    keeps its autograd link (``state_dict(keep_vars=True)``) or that DLPack cannot carry (meta, a tensor subclass
    such as DTensor) stays a plain view. What is lost: a view shares its parameter's version counter, this tensor has
    its own, so an in-place write through it between a forward and its backward escapes autograd's check."""
    if part.requires_grad or part.device.type == "meta" or type(part) is not torch.Tensor:
        return part
    try:
        return torch.utils.dlpack.from_dlpack(part)
    except (RuntimeError, TypeError, BufferError):  # a dtype or device DLPack does not carry: the view
        return part


def _merge_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """Concatenate each fused parameter's HF tensors (q, k, v rows) into its fused name. A part the dict lacks (a
    partial dict: LoRA deltas of q_proj / v_proj only) keeps the parameter's current rows and is reported missing
    under its HF name, as torch reports it for the stock model; so is every part of a fused parameter given none."""
    for new, olds in module.__dict__.get(SHARDS_ATTR, ()):
        fused = module.get_submodule(new)
        for pname in ("weight", "bias"):
            param, keys = getattr(fused, pname, None), [f"{prefix}{old}.{pname}" for old, _ in olds]
            given = [state_dict[k] for k in keys if k in state_dict]
            if param is None or (given and len(given) < len(keys) and param.device.type == "meta"):
                continue  # no rows to keep on meta: torch reports the unmerged parts
            missing_keys.extend(k for k in keys if k not in state_dict)
            if not given:
                state_dict[f"{prefix}{new}.{pname}"] = param.detach()  # loads as itself (torch: a no-op copy)
                continue
            rows = param.detach().split(_sizes(fused), dim=0)  # the current rows of parts not given
            state_dict[f"{prefix}{new}.{pname}"] = torch.cat(
                [state_dict.pop(k) if k in state_dict else r.to(given[0].device) for k, r in zip(keys, rows)], dim=0)


HF_NAMES_ATTR = "_fxrewrite_hf_param_names"
"""On an optimized model: the stock model's parameter names in `named_parameters()` order (set by `optimize`)."""


def _stock_order_hook(module, state_dict, prefix, local_metadata) -> None:
    """The parameters' HF names in the stock model's order (a fused module's parts come out where the fused
    parameter was registered, after o_proj); keys that are no stock parameter name keep their places."""
    rank = {prefix + n: i for i, n in enumerate(module.__dict__.get(HF_NAMES_ATTR) or ())}
    keys = list(state_dict)
    ranked = iter(sorted((k for k in keys if k in rank), key=rank.__getitem__))
    values = {k: state_dict.pop(k) for k in keys}
    for k in keys:
        key = next(ranked) if k in rank else k
        state_dict[key] = values[key]


def install_hf_name_hooks(model: nn.Module) -> None:
    """Register the split/merge state-dict hooks on every rewritten module, and on `model` the one putting the
    names back in the stock order when `optimize` recorded it (idempotent)."""
    for module in model.modules():
        if module.__dict__.get(SHARDS_ATTR) and not module.__dict__.get(_HOOKED):
            module.register_state_dict_post_hook(_split_hook)
            module.register_load_state_dict_pre_hook(_merge_hook)
            module.__dict__[_HOOKED] = True
    if model.__dict__.get(HF_NAMES_ATTR) and not model.__dict__.get(_ORDERED):
        model.register_state_dict_post_hook(_stock_order_hook)
        model.__dict__[_ORDERED] = True


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, loaded_shard_id=None) -> None:
    """Copy a whole tensor; ValueError on a shape mismatch (names both shapes)."""
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise ValueError(f"weight shape {tuple(loaded_weight.shape)} does not match {tuple(param.shape)}")
    if param.device.type != "meta":
        with torch.no_grad():
            param.copy_(loaded_weight)


def _loader(model: nn.Module, name: str, param: torch.Tensor):
    """The parameter's `weight_loader`, else its module's (lost when a parameter was re-created)."""
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        owner = model.get_submodule(name.rpartition(".")[0])
        loader = getattr(owner, "weight_loader", None)
    return loader if callable(loader) else default_weight_loader


class CheckpointTensorError(UserInputError):
    """A checkpoint tensor that does not fit the model's parameter (its name and shape in the message)."""


@contextlib.contextmanager
def naming_tensor(name: str):
    """Within: a weight loader's ValueError (a shape mismatch) becomes a CheckpointTensorError naming the
    checkpoint tensor `name` (the loaders' messages give its shape)."""
    try:
        yield
    except CheckpointTensorError:
        raise
    except ValueError as e:
        raise CheckpointTensorError(f"checkpoint tensor {name!r} does not fit the model: {e}") from None


class LoadedNames(set):
    """The parameter names a loader filled. A fused parameter is in the set only once every part arrived
    (a checkpoint without ``q_proj`` would leave a third of ``qkv_proj`` uninitialised); `missing_parts` maps
    each partly filled one to the checkpoint names it still lacks."""

    def __init__(self, parts: dict[str, dict[Any, str]] | None = None) -> None:
        super().__init__()
        self.parts = parts if parts is not None else {}  # fused name -> {shard id: checkpoint name}
        self.seen: dict[str, set] = {}
        self.unused: list[str] = []  # checkpoint names the model has no parameter or buffer for

    def add_shard(self, target: str, shard_id: Any, expected: dict[Any, str] | None = None) -> None:
        if expected is not None:
            self.parts.setdefault(target, expected)
        seen = self.seen.setdefault(target, set())
        seen.add(shard_id)
        if seen >= set(self.parts.get(target, seen)):
            self.add(target)

    @property
    def missing_parts(self) -> dict[str, list[str]]:
        return {t: [name for sid, name in self.parts.get(t, {}).items() if sid not in seen]
                for t, seen in self.seen.items() if t not in self}

    def prefixed(self, prefix: str) -> "LoadedNames":
        """The same names under ``prefix`` (a wrapper module's attribute)."""
        out = LoadedNames()
        out.update(prefix + name for name in self)
        for target, missing in self.missing_parts.items():
            out.parts[prefix + target] = {i: prefix + name for i, name in enumerate(missing)}
            out.seen[prefix + target] = set()
        out.unused = list(self.unused)
        return out


def load_hf_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> LoadedNames:
    """Load (HF name, tensor) pairs into `model` (optimized or not); returns the model's names loaded.

    HF names of fused parts (``...q_proj.weight``) go to the fused parameter's `weight_loader`
    with their shard id; other names load whole (through `weight_loader` when the parameter has
    one). Persistent buffers load too. Names the model does not have are skipped and listed in the result's
    ``unused`` (compare the returned set with ``dict(model.named_parameters())`` to check completeness; a fused
    parameter counts once all its parts loaded, see `LoadedNames`). Parameters must be materialised (not meta)
    for values to land. CheckpointTensorError (a ValueError) names a tensor whose shape does not fit.
    """
    shards = shard_map(model)
    parts: dict[str, dict[Any, str]] = {}
    for hf_name, (target, shard_id) in shards.items():
        parts.setdefault(target, {})[shard_id] = hf_name
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    loaded = LoadedNames(parts)
    for name, tensor in weights:
        with naming_tensor(name):
            if name in shards:
                target, shard_id = shards[name]
                _loader(model, target, params[target])(params[target], tensor, shard_id)
                loaded.add_shard(target, shard_id)
            elif name in params:
                _loader(model, name, params[name])(params[name], tensor)
                loaded.add(name)
            elif name in buffers:
                default_weight_loader(buffers[name], tensor)
                loaded.add(name)
            else:
                loaded.unused.append(name)
    _add_tied_aliases(loaded, params)
    return loaded


def _add_tied_aliases(loaded: set[str], params: dict[str, nn.Parameter]) -> None:
    """A tied parameter loads under any of its names: RoBERTa's checkpoints hold the word embeddings, while
    `named_parameters()` lists the shared tensor as ``lm_head.decoder.weight`` (the module registered first)."""
    names: dict[int, list[str]] = {}
    for name, param in params.items():
        names.setdefault(id(param), []).append(name)
    for aliases in names.values():
        if len(aliases) > 1 and any(name in loaded for name in aliases):
            loaded.update(aliases)


def to_hf_names(model: nn.Module, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map {model name: tensor shaped like that parameter} (grads, optimizer state...) to HF names.

    Fused tensors are split along their first dim into their original parts; other names pass through. A tensor
    with one leading dim more than its parameter (per-sample gradients of ``torch.func.vmap(grad(...))``, [B,
    *shape]) is split along dim 1, keeping the batch dim. ValueError naming the tensor for any other shape.
    """
    out = dict(named)
    for prefix, module in model.named_modules(remove_duplicate=False):
        for new, olds in module.__dict__.get(SHARDS_ATTR, ()):
            fused = module.get_submodule(new)
            sizes = _sizes(fused)
            for pname in ("weight", "bias"):
                key = _join(prefix, new, pname)
                if key in out:
                    value, shape = out.pop(key), tuple(getattr(fused, pname).shape)
                    batched = value.dim() == len(shape) + 1 and tuple(value.shape[1:]) == shape
                    if tuple(value.shape) != shape and not batched:
                        raise ValueError(f"to_hf_names: {key!r} has shape {tuple(value.shape)}; expected the "
                                         f"parameter's {shape} (or [batch, *{shape}] from vmap)")
                    for (old, _), part in zip(olds, value.split(sizes, dim=1 if batched else 0)):
                        out[_join(prefix, old, pname)] = part
    return out


class FusedAway(WarnsOnHooks, nn.Linear):
    """Placeholder left where `optimize` removed a child (``q_proj`` fused into ``qkv_proj``): no parameters,
    never called. It exists so that a LoRA (PEFT) target naming the removed child fails with this
    module's description (PEFT prints it in "Target module ... is not supported") instead of silently
    adapting nothing. An `nn.Linear` by type (without its attributes: `nn.Linear.__init__` never runs), so that
    code picking modules by that type fails on it with this explanation rather than silently skipping the fused
    projection: PEFT's ``target_modules="all-linear"`` (TRL's common setting, applied after the user's `optimize`;
    it adapted only o_proj and down_proj), a weight init over `model.modules()`, torchao's ``quantize_``."""

    def __init__(self, name: str, fused: str) -> None:
        nn.Module.__init__(self)
        self.name, self.fused = name, fused

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} was fused into {self.fused} by fxrewrite.optimize and is never called")

    def __getattr__(self, attr: str):
        try:
            return super().__getattr__(attr)
        except AttributeError:  # `q_proj.weight` after optimize: say where the weight went
            fused = self.__dict__.get("fused")  # absent while unpickling: the plain error
            if fused is None:
                raise
            raise FusedAwayError(f"{self.__dict__['name']!r} was fused into {fused!r} by fxrewrite.optimize and has no "
                                 f"{attr!r}: read it from {fused!r} (its rows), or from model.state_dict(), which "
                                 "keeps Hugging Face names. Code that picks nn.Linear modules by type (PEFT's "
                                 "'all-linear', a weight init, a quantizer) would miss the fused projection: apply "
                                 "it before fxrewrite.optimize (for LoRA: peft.get_peft_model first)") from None

    def requires_grad_(self, requires_grad: bool = True):
        """Nothing to set when the fused module's parameters already agree (a loop over ``model.modules()``
        reaches the parent first); else FusedAwayError: the weight this would set is rows of the fused parameter
        (freezing ``q_proj`` here had silently frozen nothing, a fresh user's find)."""
        parent = self.__dict__.get("_parent")  # not a registered child: no cycle in modules()
        fused = getattr(parent, self.fused, None) if parent is not None else None
        if isinstance(fused, nn.Module) and all(p.requires_grad == requires_grad for p in fused.parameters()):
            return self
        raise FusedAwayError(f"{self.name}.requires_grad_({requires_grad}): {self.name!r} was fused into "
                             f"{self.fused!r} by fxrewrite.optimize and has no parameters of its own. Set "
                             f"requires_grad before fxrewrite.optimize (q/k/v or gate/up that differ in it stay "
                             f"unfused), freeze the whole {self.fused!r}, or optimize(model, merge_weights=False)")

    def _hook_warning_text(self) -> str:
        return (f"a hook on {self.name!r} never runs: it was fused into {self.fused!r} by fxrewrite.optimize "
                f"(hook {self.fused!r}, whose output holds its rows, or register the hook before optimize)")

    def _get_name(self) -> str:
        # torch's own messages name a module by this (get_parameter: "<name> has no attribute `weight`")
        return f"FusedAway({self.name} -> {self.fused}, fxrewrite.optimize)"

    def extra_repr(self) -> str:
        return (f"{self.name!r} was fused into {self.fused!r} by fxrewrite.optimize; to train LoRA adapters on it, "
                f"apply peft.get_peft_model first and then fxrewrite.optimize (the LoRA-wrapped projections stay unfused)")


def mark_fused_away(model: nn.Module) -> None:
    """Put a `FusedAway` where each fused child was (see its docstring)."""
    for module in model.modules():
        for new, olds in module.__dict__.get(SHARDS_ATTR, ()):
            for old, _ in olds:
                if "." not in old and old not in module._modules and not hasattr(module, old):
                    away = FusedAway(old, new)
                    object.__setattr__(away, "_parent", module)
                    module.add_module(old, away)
