"""Checkpoints of a base model loaded into a model with a head, as transformers' `from_pretrained` loads them.

A folder saved from ``Qwen3Model`` (tensors ``layers.0.…``, ``embed_tokens.weight``; embedding checkpoints such as
Qwen3-Embedding are saved so) holds no ``model.`` prefix, while the engine's model (``Qwen3ForCausalLM``, native or
transformers) names them ``model.layers.0.…``. transformers adds the model's ``base_model_prefix`` to each key the
model does not hold as it is (a head saved beside: ``lm_head.weight``) when no checkpoint key has it and the model's
keys do (loading a task model from a base-model state dict); so does the engine. The head is then absent: a pooling model never reads it (vLLM's pooling models
delete it), a generating one is refused by `loader.check_all_loaded` unless it is tied to the embeddings.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn


def base_prefix(root: nn.Module) -> str:
    """``"model."``: the root's ``base_model_prefix`` and a dot ("model" for a native model without one)."""
    return (getattr(root, "base_model_prefix", "") or "model") + "."


def missing_prefix(root: nn.Module, keys: list[str]) -> str | None:
    """`base_prefix` when no checkpoint key (as transformers' renamings leave it: a VLM's legacy
    ``language_model.model.*`` is ``model.language_model.*``) starts with it and some key names, once prefixed, a
    module of `root` that it does not name without the prefix (transformers' test for a task model loaded from a base
    model's state dict, kept to names this model has); else None."""
    prefix = base_prefix(root)
    if not keys or any(k.startswith(prefix) for k in keys):
        return None
    return prefix if any(_has_owner(root, prefix + k) and not _has_owner(root, k) for k in keys) else None


def _has_owner(root: nn.Module, name: str) -> bool:
    """Whether the module that would hold tensor `name` (its path less the last part) exists in `root`; a native
    model's fused parts (`packed_modules_mapping`: ``q_proj`` in ``qkv_proj``) count as their fused module."""
    for part, (fused, _) in getattr(root, "packed_modules_mapping", {}).items():
        if part in name:
            name = name.replace(part, fused)
            break
    owner = name.rpartition(".")[0]
    try:
        root.get_submodule(owner)
    except AttributeError:
        return False
    return bool(owner)


def with_prefix(weights: Iterable[tuple[str, torch.Tensor]], prefix: str,
                root: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` with `prefix` put before every name but one `root` holds as it is (a head saved beside the base
    model, ``lm_head.weight``: transformers 5 prefixes only the keys the model names with the prefix)."""
    return ((name if _has_owner(root, name) else prefix + name, tensor) for name, tensor in weights)


def head_parameter_names(root: nn.Module) -> list[str]:
    """The parameters of `root` outside its base model (`base_prefix`): the output head and what leads to it
    (``lm_head.weight``; BERT's ``cls.predictions.*``), which the pooled hidden states never pass through. None
    when the root has no base-model child (all its names are its own)."""
    prefix = base_prefix(root)
    names = [n for n, _ in root.named_parameters()]
    return [n for n in names if not n.startswith(prefix)] if any(n.startswith(prefix) for n in names) else []
