"""The serving engine's paged KV cache in the running step, for fused layers that write K/V themselves.

A rewritten attention's q/k-norm + rotary op that is also given the values (`fxrewrite.patterns.qk_norm_rope`)
writes the step's rotated keys and its values into the layer's paged cache from the same launch, as the
native Qwen3 does (`fxrewrite.kernels.qk_norm_rope_cache`), and notes which tensors it wrote. The engine's
attention function (`fxrewrite.runtime.worker.attention`) skips its own write only when it is handed exactly
those tensors for that layer; any other key or value it writes itself, over the same slots.

The engine sets the step for every forward it runs (`fxrewrite.runtime.worker.forward_context`); outside
it nothing is set and the layers write nothing. A module global, like `fxrewrite.layers.rope_context`, keeps
the models' forward signatures unchanged.
"""

from __future__ import annotations

import torch

_step = None  # the step's attention metadata: .kv_caches [(key_cache, value_cache)] per layer, .slot_mapping
_written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def set_kv_step(step) -> None:
    """Set the running step (None: none); what the previous step's layers wrote is forgotten."""
    global _step
    _step = step
    _written.clear()


def layer_kv_cache(layer_idx: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(key_cache, value_cache [num_blocks, block_size, Hkv, D], slot_mapping int64 [>= T]) of layer
    `layer_idx` in the running step; None for no layer, outside the engine and while torch.compile traces
    (the compiled attention op writes the cache itself)."""
    if layer_idx is None or _step is None or torch.compiler.is_compiling():
        return None
    key_cache, value_cache = _step.kv_caches[layer_idx]
    return key_cache, value_cache, _step.slot_mapping


def mark_kv_written(layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Note that `key` and `value` (these tensors, which no one changes before the attention reads them)
    are in layer `layer_idx`'s cache at the step's slots."""
    _written[layer_idx] = (key, value)


def take_kv_written(layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether exactly `key` and `value` were written to layer `layer_idx`'s cache in this step (the note
    is dropped: one attention call per note)."""
    if torch.compiler.is_compiling():
        return False
    found = _written.pop(layer_idx, None)
    return found is not None and found[0] is key and found[1] is value
