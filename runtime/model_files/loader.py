"""Checkpoint loading: safetensors into native models (packed_modules_mapping) or HF models."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from fxrewrite.distributed import get_tp_size
from fxrewrite.errors import UserFileNotFoundError, UserInputError
from fxrewrite.sharding import LazySlice
from fxrewrite.weights import CheckpointTensorError, LoadedNames, load_hf_weights, naming_tensor
from fxrewrite.runtime.model_files.base_model import head_parameter_names, missing_prefix, with_prefix
from fxrewrite.runtime.model_files.checkpoint_conversion import convert_for_model, renamed_keys
from fxrewrite.runtime.model_files.fp8_experts import dequantize_fp8_experts

logger = logging.getLogger(__name__)
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def checkpoint_files(model_path: str | Path) -> list[Path]:
    """The folder's weight files, chosen as transformers chooses them: ``model.safetensors`` if present, else the
    files named by ``model.safetensors.index.json`` (so a Mistral folder's ``consolidated.safetensors`` or a stale
    shard beside them is not read), else every ``*.safetensors`` file. UserFileNotFoundError when there is none
    or the index names a file that is not there; UserInputError for an index without a ``weight_map``."""
    folder = Path(model_path)
    if (folder / SAFE_WEIGHTS_NAME).is_file():
        return [folder / SAFE_WEIGHTS_NAME]
    index = folder / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({folder / name for name in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserInputError(f"{index} is not a safetensors index (a JSON object with a weight_map of tensor "
                                 f"name -> file name): {e!r}") from None
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise UserFileNotFoundError(f"{index} names weight files that are not in {folder}: {', '.join(absent)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserFileNotFoundError(f"no *.safetensors file in {model_path}: expected the model's weights there "
                                    "(or pass a .gguf file)")
    return files


def iterate_safetensors(model_path: str | Path, sliced: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the folder's weight files (`checkpoint_files`).

    With `sliced` (tensor-parallel ranks) each tensor comes as a `LazySlice`, read only where a
    weight loader narrows it; 0-d tensors are read whole. The file stays open while the item is held.
    """
    for file in checkpoint_files(model_path):
        with _safe_open(file) as f:
            for name in f.keys():
                if not sliced:
                    yield name, f.get_tensor(name)
                    continue
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                yield name, (LazySlice(sl, shape) if shape else f.get_tensor(name))


def checkpoint_keys(model_path: str | Path) -> list[str]:
    """The tensor names of the folder's weight files (`checkpoint_files`; their headers only)."""
    keys: list[str] = []
    for file in checkpoint_files(model_path):
        with _safe_open(file) as f:
            keys.extend(f.keys())
    return keys


def _safe_open(file: Path):
    """safetensors' `safe_open` of `file` (torch tensors); UserInputError for a truncated or corrupt file."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="pt")
    except SafetensorError as e:
        raise UserInputError(f"{file} is not a readable safetensors file: {e}") from None


def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """Replace meta parameters by empty ones on `device` (keeping tied parameters tied and attributes
    such as `weight_loader`); move buffers there. Values are set by the loader afterwards."""
    new_params: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in new_params:
                data = torch.empty(param.shape, dtype=param.dtype, device=device)
                if param.device.type != "meta":
                    data.copy_(param.data)
                new = nn.Parameter(data, requires_grad=False)
                new.__dict__.update(param.__dict__)
                new_params[id(param)] = new
            module._parameters[name] = new_params[id(param)]
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = buf.to(device)
    return model


def load_native_weights(model: nn.Module, weights) -> LoadedNames:
    """Load HF-named checkpoint tensors into a native model; returns the parameter names loaded.

    `model.packed_modules_mapping` maps a checkpoint name part to (fused name part, shard id), e.g.
    "q_proj" -> ("qkv_proj", "q"); each parameter's `weight_loader` copies the shard in place.
    """
    mapping = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    loaded = LoadedNames()
    for name, tensor in weights:
        if name not in params and _skip(name, model):
            continue
        with naming_tensor(name):
            _load_one(model, params, mapping, loaded, name, tensor)
    return loaded


def _load_one(model: nn.Module, params: dict, mapping: dict, loaded: LoadedNames, name: str, tensor) -> None:
    for part, (fused, shard) in mapping.items():
        if part in name:
            target = name.replace(part, fused)
            _param(model, params, target, name).weight_loader(params[target], tensor, shard)
            # Every checkpoint part that fuses into this parameter must arrive (q, k and v).
            expected = {sid: name.replace(part, p) for p, (f, sid) in mapping.items() if f == fused}
            loaded.add_shard(target, shard, expected)
            return
    param = _param(model, params, name, name)
    getattr(param, "weight_loader", _default_loader)(param, tensor)
    loaded.add(name)


def _without_extra_layers(model: nn.Module, weights):
    """`weights` without the decoder layers past the model's (a config whose num_hidden_layers was lowered
    by hf_overrides: transformers loads such a checkpoint too, warning that weights were unused)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        yield from weights
        return
    skipped = set()
    for name, tensor in weights:
        found = _LAYER_INDEX.search(name)
        if found and int(found.group(1)) >= len(layers):
            skipped.add(int(found.group(1)))
            continue
        yield name, tensor
    if skipped:
        logger.warning("the checkpoint's decoder layers %s are not loaded: the model has num_hidden_layers=%d "
                       "(hf_overrides?)", sorted(skipped), len(layers))


def _skip(name: str, model: nn.Module) -> bool:
    """Checkpoint tensors a native model has no parameter for: rotary caches, a tied lm_head."""
    if "rotary_emb.inv_freq" in name:
        return True
    return name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False)


def _param(model: nn.Module, params: dict, target: str, name: str) -> nn.Parameter:
    # Refused, not skipped as transformers does: a tensor the native model lacks (a bias, a norm) means it
    # was built for another config and would compute something else.
    if target not in params:
        raise CheckpointTensorError(f"checkpoint tensor {name!r} has no parameter in the native "
                                    f"{type(model).__name__} (a checkpoint of another architecture or config? "
                                    "model_impl='transformers' loads it as transformers does)")
    return params[target]


def _default_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded)


def check_all_loaded(model: nn.Module, loaded: set[str], model_path: str | Path | None = None,
                     hint: str = "") -> None:
    """UserInputError (a ValueError) naming the parameters the checkpoint in `model_path` did not provide (they
    would hold garbage), in checkpoint names: for a fused parameter with only some parts in the checkpoint
    (`LoadedNames`), the missing parts; the transformers wrapper's ``hf_model.`` prefix left out."""
    parts = getattr(loaded, "missing_parts", {})
    missing = []
    for name in sorted(set(dict(model.named_parameters())) - loaded):
        missing.extend(n.removeprefix("hf_model.") for n in parts.get(name) or [name])
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        where = f" in {model_path}" if model_path is not None else ""
        raise UserInputError(f"the checkpoint{where} is missing {len(missing)} parameter(s): {shown}{hint}")


def load_weights(model: nn.Module, model_path: str | Path, native: bool,
                 fp8_block: tuple[int, int] | None = None, pooling: bool = False) -> None:
    """Load the folder's safetensors into the model (native or HF) and check nothing is missing.
    `fp8_block`: an FP8 checkpoint's ``weight_block_size`` (its expert weights are dequantized as they load).
    A base model's checkpoint (no ``model.`` prefix) loads as transformers loads it (`base_model`); `pooling`: the
    output head may be absent (it is never read; zero-filled then)."""
    root = model if native else model.hf_model
    # On a TP rank, read only this rank's slice of each sharded tensor.
    weights = iterate_safetensors(model_path, sliced=get_tp_size() > 1)
    prefix = missing_prefix(root, renamed_keys(model, checkpoint_keys(model_path), native))
    if prefix is not None:
        logger.info("the checkpoint in %s is a base model's (no %r prefix): loaded as transformers loads it, "
                    "its names prefixed", model_path, prefix)
        weights = with_prefix(weights, prefix, root)
    dropped = tuple(getattr(model, "pp_dropped_prefixes", ()))  # layers of other pipeline stages
    if dropped:
        weights = ((name, t) for name, t in weights if not name.startswith(dropped))
    # FP8 experts dequantized, then per-expert checkpoints -> transformers 5's fused 3-D experts
    # (transformers' own rules).
    if fp8_block is not None:
        weights = dequantize_fp8_experts(weights, fp8_block)
    weights = convert_for_model(model, weights, native)
    try:
        if native:
            loaded = load_native_weights(model, _without_extra_layers(model, weights))
        else:
            loaded = load_hf_weights(model.hf_model, weights).prefixed("hf_model.")
    except CheckpointTensorError as e:
        raise CheckpointTensorError(f"the checkpoint in {model_path}: {e}") from None
    if pooling:  # the head is never read: a checkpoint without it (an embedding model's) loads
        wrapper = "" if native else "hf_model."
        for name in {wrapper + n for n in head_parameter_names(root)} - set(loaded):
            model.get_parameter(name).data.zero_()
            loaded.add(name)
    if loaded.unused:  # transformers' own rule for the model it builds: warn, load the rest
        shown = ", ".join(loaded.unused[:5]) + (" ..." if len(loaded.unused) > 5 else "")
        logger.warning("%d tensor(s) of the checkpoint in %s are not used by the model: %s", len(loaded.unused),
                       model_path, shown)
    base = " (a base model's checkpoint: no output head; runner='pooling' serves its embeddings)" if prefix else ""
    check_all_loaded(model, loaded, model_path, base)
