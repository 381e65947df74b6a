"""One dummy step at load, before compilation and the KV cache: a model the engine would serve wrongly or not at all
fails here, with its name, instead of on its first request (or never, generating from a different model).

It catches (a) attention arguments the paged kernels do not compute (`position_bias`: NotImplementedError from
`paged_attention_forward`), (b) transformers models whose attention layers do not call transformers' attention
interface (CPM-Ant computes its own: with the engine's `use_cache=False` step every decode step would attend to its
own token only), (c) anything else the forward raises, and lets the transformers backend check its LM head on real
hidden states. Eager: it runs before `compile_model`, so the Python-side record of attention calls is seen.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fxrewrite.distributed import get_tp_size
from fxrewrite.errors import UnsupportedModelError, UserInputError
from fxrewrite.runtime.worker.attention import recording_attention_layers
from fxrewrite.runtime.worker.kv_cache import allocate_kv_caches
from fxrewrite.runtime.worker.warmup import dummy_forward, dummy_metadata, run_dummy_steps

LOAD_CHECK_STEP = ((2, 2),)
"""One sequence, two prompt tokens (one KV block; no KV written: see warmup.dummy_metadata)."""


def check_first_step(model: nn.Module, config, model_config, device: torch.device, kv_dtype: torch.dtype) -> None:
    """Run LOAD_CHECK_STEP through `model` over a one-block cache. NotImplementedError when a layer listed in the
    model's `attention_layer_indices` (transformers backend) never reached the paged cache, when the model asked
    for attention the kernels do not compute, or when a transformers model's output ignores the position ids
    (`_check_positions_are_read`); RuntimeError naming the model for any other failure of the step."""
    name = type(getattr(model, "hf_model", model)).__name__
    caches = allocate_kv_caches(model_config, 1, config.block_size, kv_dtype, device)
    seen: dict[int, tuple[int, int]] = {}
    try:
        with recording_attention_layers() as seen:
            run_dummy_steps(model, caches, config, device, [LOAD_CHECK_STEP], "load check step")
    except UnsupportedModelError as e:  # the attention call's refusal names the attention class, not the model
        if str(e).startswith(name):
            raise
        raise UnsupportedModelError(f"{name}: {e}") from e
    except (NotImplementedError, UserInputError):
        raise
    except Exception as e:
        _check_kv_layout(name, seen, caches, e)
        raise RuntimeError(f"{name}: a two-token dummy step at load failed ({type(e).__name__}: {e}); "
                           "the model cannot be served as built") from e
    expected = getattr(model, "attention_layer_indices", None)
    missing = sorted(set(expected or ()) - set(seen))
    if missing:
        raise UnsupportedModelError(
            f"{name}: the attention of layers {missing} does not call transformers' attention interface (it computes "
            "attention in its own code), so the paged KV cache never sees it; this model cannot be served by the "
            "transformers backend")
    if hasattr(model, "hf_model") and model_config.max_model_len > 2 and not _has_rotary(model):
        _check_positions_are_read(model, caches, config, device, name, min(7, model_config.max_model_len - 1))


def _has_rotary(model: nn.Module) -> bool:
    """Whether the model rotates by positions (a transformers rotary module, with its `inv_freq`, or fxrewrite's
    replacement): transformers computes rotary cos / sin from the position ids it is given, so only models without
    one (learned or sinusoidal positions, which some compute from their own cache length) need the check below."""
    return any("inv_freq" in m._buffers or "Rotary" in type(m).__name__ for m in model.modules())


def _check_positions_are_read(model: nn.Module, caches, config, device: torch.device, name: str, far: int) -> None:
    """UnsupportedModelError when two different tokens at positions [0, 1] and at [0, far] give the second token the
    same hidden state: the model numbers positions itself (BART's decoder counts from its own cache's length and takes
    no position ids), so in the engine's cacheless steps every decoded token would sit at position 0. Learned and
    sinusoidal positions see the distance change (a model with no position information at all would be refused too;
    rotary models are not checked, `_has_rotary`). The step writes its keys and values into the check's own one-block
    cache, so attention reads them."""
    positions, metadata = dummy_metadata(LOAD_CHECK_STEP, config.block_size, device, caches)
    metadata = dataclasses.replace(metadata, slot_mapping=torch.arange(len(positions), device=device))
    tokens = torch.tensor([1, 2], device=device)
    base = dummy_forward(model, metadata, positions, tokens)
    moved = dummy_forward(model, metadata, torch.tensor([0, far], device=device), tokens)
    if torch.equal(base[1], moved[1]):
        raise UnsupportedModelError(
            f"{name}: the position ids the engine passes do not change its output (its decoder numbers positions "
            "from its own cache, as BART's does), so each decoded token would be placed at position 0; this model "
            "cannot be served by the transformers backend")


def check_position_table(model: nn.Module, max_model_len: int) -> None:
    """UserInputError when `max_model_len` reaches past the model's learned position table (`max_positions` of the
    transformers backend: RoBERTa-style embeddings number positions from padding_idx + 1, so 514 entries hold 512
    tokens); the embedding lookup would fail mid-request."""
    limit = getattr(model, "max_positions", None)
    if limit is not None and max_model_len > limit:
        name = type(getattr(model, "hf_model", model)).__name__
        raise UserInputError(
            f"max_model_len={max_model_len} is longer than {name}'s position table holds ({limit} tokens: "
            f"max_position_embeddings less its position offset of {model.position_offset}); pass max_model_len={limit} "
            "or less")


def _check_kv_layout(name: str, seen: dict[int, tuple[int, int]], caches, error: Exception) -> None:
    """NotImplementedError where a layer attended with other key/value heads than the cache the config sized
    (a config field the model's code does not read: Falcon's `multi_query`, a stray `num_key_value_heads`), or a layer
    index past the layers the config gives (BART's `num_hidden_layers` names its encoder's, its decoder has
    `decoder_layers`)."""
    beyond = sorted(layer for layer in seen if layer >= len(caches))
    if beyond:
        raise UnsupportedModelError(
            f"{name}: layer {beyond[0]} attends, but the config gives {len(caches)} layers (num_hidden_layers), which "
            "the KV cache is sized from: the config does not describe this model's layers") from error
    for layer, (heads, width) in seen.items():
        cached = tuple(caches[layer][0].shape[-2:])
        tp = get_tp_size()
        if tp > 1 and (heads, width) == (cached[0] * tp, cached[1]):
            raise UnsupportedModelError(
                f"{name}: layer {layer} attends with all {heads} key/value heads on each of the {tp} tensor-parallel "
                f"ranks (this rank's cache holds {cached[0]}): nothing sharded its attention (the model's "
                "base_model_tp_plan, if any, splits no attention head, and fusion is off or did not prove its "
                "projections: `fxrewrite explain` says why); run it with fusion on where that proves them, or at "
                "tensor_parallel_size=1") from error
        if (heads, width) != cached:
            raise UnsupportedModelError(
                f"{name}: layer {layer} attends with {heads} key/value heads of width {width}, but the config gives "
                f"{cached[0]} of width {cached[1]} (num_key_value_heads / head_dim), which the KV cache is sized "
                "from: the config does not describe this model's attention") from error
