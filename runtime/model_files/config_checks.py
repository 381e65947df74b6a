"""Check a loaded config's model dimensions (after hf_overrides) before anything is built from them.

transformers accepts `num_hidden_layers=0` or a head count that does not divide the KV heads; the
engine would then fail deep inside (a division by zero sizing the KV cache, a paged-attention shape
error on the first step, a weight loader's shape error). These checks name the key, its value, and
whether hf_overrides set it.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxrewrite.errors import UnsupportedModelError, UserInputError
from fxrewrite.runtime.model_files.hf_config import MAX_LEN_KEYS, load_hf_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_POSITIVE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", *MAX_LEN_KEYS)
# Keys that shape a checkpoint tensor: a new value cannot load the checkpoint's weights.
_WEIGHT_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                      "num_attention_heads", "num_key_value_heads", "head_dim")


def config_json_values(model_path: Path, composite: bool) -> dict[str, Any]:
    """config.json's own values for the text config (its `text_config` when `composite`), {} if unreadable."""
    try:
        raw = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    nested = raw.get("text_config") if isinstance(raw, dict) else None
    return nested if composite and isinstance(nested, dict) else raw if isinstance(raw, dict) else {}


def check_model_dimensions(text_config: PretrainedConfig, original: dict[str, Any]) -> None:
    """UserInputError unless every dimension present is a positive int, the query heads are a multiple
    of the KV heads and (without `head_dim`) hidden_size divides into the heads; UnsupportedModelError for a config
    whose layers differ in shape (transformers' `per_layer_config`). `original`: config.json's
    values, to say when hf_overrides changed the offending key."""
    if getattr(text_config, "is_heterogeneous", False):  # transformers' per_layer_config (5.2x): no global shape
        raise UnsupportedModelError(
            f"{text_config.model_type}: its layers differ in {', '.join(sorted(text_config.per_layer_attributes))} "
            "(per_layer_config), while fxrewrite's engine sizes every layer (KV cache, kernels) alike; this model "
            "cannot be served here")
    if not hasattr(text_config, "num_attention_heads"):  # e.g. hf_overrides' text_config on a plain LM: a dict
        raise UserInputError(f"the text config is a {type(text_config).__name__}, not a model config "
                             "(hf_overrides text_config on a model without one?)")
    for key in _POSITIVE_KEYS:
        value = getattr(text_config, key, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserInputError(f"{key}={value!r} must be a positive integer{_origin((key,), text_config, original)}")
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        origin = _origin(("num_attention_heads", "num_key_value_heads"), text_config, original)
        raise UserInputError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
                             f"{origin}: each KV head serves a whole group of query heads")
    layer_types, layers = getattr(text_config, "layer_types", None), text_config.num_hidden_layers
    if isinstance(layer_types, (list, tuple)) and len(layer_types) < layers:  # read per layer by the models
        origin = _origin(("num_hidden_layers",), text_config, original)
        raise UserInputError(f"num_hidden_layers={layers}{origin} but layer_types names {len(layer_types)} "
                             "layers; give layer_types (one entry per layer) in hf_overrides too")
    if getattr(text_config, "head_dim", None) is None and text_config.hidden_size % heads:
        origin = _origin(("hidden_size", "num_attention_heads"), text_config, original)
        raise UserInputError(f"hidden_size={text_config.hidden_size} is not a multiple of num_attention_heads={heads}"
                             f"{origin}, and the config sets no head_dim")


def check_weights_fit(text_config: PretrainedConfig, original: dict[str, Any], model_path: Path) -> None:
    """UserInputError when hf_overrides changed a dimension the checkpoint's tensors are shaped by (or asked
    for more decoder layers than it holds): its weights cannot load. load_format='dummy' skips this check."""
    changed = [f"{key} {original[key]} -> {getattr(text_config, key, None)}" for key in _WEIGHT_SHAPE_KEYS
               if key in original and getattr(text_config, key, None) != original[key]]
    layers, saved = getattr(text_config, "num_hidden_layers", None), original.get("num_hidden_layers")
    if isinstance(saved, int) and isinstance(layers, int) and layers > saved:
        changed.append(f"num_hidden_layers {saved} -> {layers} (the checkpoint holds {saved} layers)")
    if changed:
        raise UserInputError(f"hf_overrides changed {', '.join(changed)}, so the weights in {model_path} do not fit "
                             "the model; use load_format='dummy' (--load-format dummy) for random weights of the new shape")


def _origin(keys: tuple[str, ...], text_config: PretrainedConfig, original: dict[str, Any]) -> str:
    """" (hf_overrides changed KEY from OLD)" for those of `keys` whose value differs from config.json's."""
    changed = [f"{key} from {original[key]!r}" for key in keys
               if key in original and original[key] != getattr(text_config, key, None)]
    return f" (hf_overrides changed {', '.join(changed)})" if changed else ""


def check_config_overrides(config: dict[str, Any], overrides: dict[str, Any], name: str) -> None:
    """Check `overrides` against a config given as a dict named `name` (a benchmark's model spec, written
    to a weightless folder): load it with them as `ModelConfig.from_pretrained` would, run the same checks
    (a quantization_config too, as the engine reads it). Raises UserInputError naming the key and value."""
    from fxrewrite.runtime.model_files.quantization import resolve_quantization  # imports the layers
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config))
        try:
            hf_config, _ = load_hf_config(folder, overrides)
        except UserInputError as e:  # the message names the folder: name the config instead
            raise UserInputError(str(e).replace(folder, name)) from None
    text_config = hf_config.get_text_config()
    nested = config.get("text_config")
    check_model_dimensions(text_config, nested if text_config is not hf_config and isinstance(nested, dict) else config)
    resolve_quantization(None, hf_config)
