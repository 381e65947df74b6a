"""One dummy step at load, before compilation and the KV cache: a model the engine would serve wrongly or not at all
fails here, with its name, instead of on its first request (or never, generating from a different model).

It catches (a) attention arguments the paged kernels do not compute (`position_bias`: NotImplementedError from
`paged_attention_forward`), (b) transformers models whose attention layers do not call transformers' attention
interface (CPM-Ant computes its own: with the engine's `use_cache=False` step every decode step would attend to its
own token only), (c) anything else the forward raises, and lets the transformers backend check its LM head on real
hidden states. Eager: it runs before `compile_model`, so the Python-side record of attention calls is seen.
"""

from __future__ import annotations

import torch
from torch import nn

from fxrewrite.distributed import get_tp_size
from fxrewrite.errors import UnsupportedModelError, UserInputError
from fxrewrite.runtime.worker.attention import recording_attention_layers
from fxrewrite.runtime.worker.kv_cache import allocate_kv_caches
from fxrewrite.runtime.worker.warmup import run_dummy_steps

LOAD_CHECK_STEP = ((2, 2),)
"""One sequence, two prompt tokens (one KV block; no KV written: see warmup.dummy_metadata)."""


def check_first_step(model: nn.Module, config, model_config, device: torch.device, kv_dtype: torch.dtype) -> None:
    """Run LOAD_CHECK_STEP through `model` over a one-block cache. NotImplementedError when a layer listed in the
    model's `attention_layer_indices` (transformers backend) never reached the paged cache, or when the model asked
    for attention the kernels do not compute; RuntimeError naming the model for any other failure of the step."""
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


def _check_kv_layout(name: str, seen: dict[int, tuple[int, int]], caches, error: Exception) -> None:
    """NotImplementedError where a layer attended with other key/value heads than the cache the config sized
    (a config field the model's code does not read: Falcon's `multi_query`, a stray `num_key_value_heads`)."""
    for layer, (heads, width) in seen.items():
        cached = tuple(caches[layer][0].shape[-2:])
        tp = get_tp_size()
        if tp > 1 and (heads, width) == (cached[0] * tp, cached[1]):
            raise UnsupportedModelError(
                f"{name}: layer {layer} attends with all {heads} key/value heads on each of the {tp} tensor-parallel "
                f"ranks (this rank's cache holds {cached[0]}): nothing sharded its attention (no tensor-parallel plan "
                "in the model, and fusion off or not proven); run it at tensor_parallel_size=1") from error
        if (heads, width) != cached:
            raise UnsupportedModelError(
                f"{name}: layer {layer} attends with {heads} key/value heads of width {width}, but the config gives "
                f"{cached[0]} of width {cached[1]} (num_key_value_heads / head_dim), which the KV cache is sized "
                "from: the config does not describe this model's attention") from error
