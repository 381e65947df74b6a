"""Load a model's transformers config with `hf_overrides`, normalise RoPE, derive `max_model_len`.

hf_overrides (DESIGN.md): a dict, its JSON text (CLI), or a callable(config) -> config. In a dict,
keys whose value is a dict are applied after the config loads (merged into a nested sub-config such
as `text_config`, otherwise set whole: a `rope_parameters` / `rope_scaling` dict replaces the old one
in the config the language model reads, keeping its theta and mrope keys, and needs a `rope_type`
when it sets anything else); the other
keys are passed to `AutoConfig.from_pretrained` at load. A top-level `max_model_len` key is taken
out and returned as the offline API's way to set it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from fxrewrite.errors import UserInputError, UserTypeError
from fxrewrite.layers.rope_init import SUPPORTED_ROPE_TYPES, normalize_rope_parameters, validate_rope_parameters
from fxrewrite.runtime.model_files.positions import learned_position_offset

logger = logging.getLogger(__name__)

HfOverrides = dict[str, Any] | str | Callable[[PretrainedConfig], PretrainedConfig] | None

MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
"""Config keys that bound the context length; the derived length is the minimum of those present."""

ALLOW_LONG_ENV_VARS = ("FXREWRITE_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN")
_DEFAULT_MAX_MODEL_LEN = 2048  # vLLM's fallback when a config names no length at all
_ROPE_FACTS = ("rope_theta", "partial_rotary_factor")  # model facts, not scaling choices


def parse_hf_overrides(hf_overrides: HfOverrides) -> dict[str, Any] | Callable | None:
    """Return the overrides as a dict (parsing JSON text) or the callable unchanged.

    Raises ValueError for text that is not a JSON object, TypeError for any other kind of value.
    """
    if hf_overrides is None or callable(hf_overrides):
        return hf_overrides
    if isinstance(hf_overrides, str):
        try:
            hf_overrides = json.loads(hf_overrides)
        except json.JSONDecodeError as exc:
            raise UserInputError(f"hf_overrides must be a JSON object, got {hf_overrides!r} ({exc})") from None
        if not isinstance(hf_overrides, dict):
            raise UserInputError(f"hf_overrides must be a JSON object, got {json.dumps(hf_overrides)!r}")
    if not isinstance(hf_overrides, dict):
        raise UserTypeError(
            f"hf_overrides must be a dict, a JSON object string or a callable(config) -> config, "
            f"got {type(hf_overrides).__name__}"
        )
    return dict(hf_overrides)


def split_hf_overrides(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], int | None]:
    """(keys passed at load, dict-valued keys applied after load, max_model_len or None)."""
    overrides = dict(overrides)
    if "torch_dtype" in overrides:  # transformers 5's deprecated alias, which it would drop unchecked
        if "dtype" in overrides and overrides["dtype"] != overrides["torch_dtype"]:
            raise UserInputError(f"hf_overrides sets dtype={overrides['dtype']!r} and its old name "
                                 f"torch_dtype={overrides['torch_dtype']!r}; give one")
        overrides["dtype"] = overrides.pop("torch_dtype")
    max_model_len = overrides.pop("max_model_len", None)
    if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)):
        raise UserInputError(f"hf_overrides['max_model_len'] must be an int, got {max_model_len!r}")
    qc = overrides.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):  # transformers would drop it without a word
        raise UserInputError(f"hf_overrides['quantization_config'] must be a JSON object such as {{\"quant_method\": "
                             f"\"fp8\", \"weight_block_size\": [128, 128]}}, got {qc!r}; to quantize a float "
                             "checkpoint at load, pass quantization='fp8' (--quantization fp8)")
    nested = {k: v for k, v in overrides.items() if isinstance(v, dict)}
    flat = {k: v for k, v in overrides.items() if not isinstance(v, dict)}
    return flat, nested, max_model_len


def load_hf_config(
    model_path: str | Path,
    hf_overrides: HfOverrides = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[PretrainedConfig, int | None]:
    """Load `model_path`'s config with the overrides applied; returns (config, max_model_len from
    the overrides or None). RoPE parameters are normalised afterwards (`rope_type`, `rope_theta`).

    Raises ValueError / TypeError for malformed overrides, OSError when no config.json is found.
    """
    overrides = parse_hf_overrides(hf_overrides)
    config_json = Path(model_path) / "config.json"
    if config_json.is_file():  # transformers' own message for this is an OSError with a traceback in the CLI
        try:
            json.loads(config_json.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise UserInputError(f"{config_json} is not valid JSON: {e}") from None
    flat, nested, max_model_len = ({}, {}, None) if not isinstance(overrides, dict) else split_hf_overrides(overrides)
    try:
        config = AutoConfig.from_pretrained(
            str(model_path), revision=revision, trust_remote_code=trust_remote_code, **flat
        )
    except KeyError as exc:  # transformers' rope validation raises a bare KeyError
        if "rope" not in str(exc):
            raise
        raise UserInputError(f"invalid rope parameters in {model_path}: {exc.args[0]}") from None
    except ValueError as exc:  # transformers' own config checks (an unknown model_type, a bad value)
        raise UserInputError(f"cannot load the config of {model_path}: {exc}") from exc
    except (StrictDataclassError, TypeError, AttributeError) as exc:
        # transformers 5 configs are strict dataclasses: a flat override of the wrong type, or one that
        # fails a config's own check, ends here (a bad `dtype` name as torch's AttributeError).
        if not flat:
            raise
        config_json = Path(model_path) / "config.json"
        raise _override_error(exc, flat, f"the config of {model_path}", _config_class(config_json)) from None
    _warn_unknown_keys(config, {**flat, **nested}, Path(model_path) / "config.json")
    for key, value in flat.items():  # from_pretrained drops a kwarg its config lacks; vLLM's config.update sets it
        if not hasattr(config, key):
            setattr(config, key, value)
    # transformers only setdefaults a flat rope_theta into rope_parameters: make the override win.
    forced = {k: v for k, v in flat.items() if k in _ROPE_FACTS}
    fallback = {**_rope_facts_from_json(Path(model_path) / "config.json"), **forced}
    for sub_config in _config_and_text_config(config):
        _normalize_config_rope(sub_config, fallback, forced=forced)
    _apply_nested_overrides(config, nested)
    if callable(overrides):
        config = overrides(config)
        if not isinstance(config, PretrainedConfig):
            raise UserTypeError(f"the hf_overrides callable must return a PretrainedConfig, got {type(config).__name__}")
    for sub_config in _config_and_text_config(config):
        _normalize_config_rope(sub_config, fallback, forced={})
    return config, max_model_len


def _config_and_text_config(config: PretrainedConfig) -> list[PretrainedConfig]:
    text_config = config.get_text_config()
    return [config] if text_config is config else [config, text_config]


def _rope_facts_from_json(path: Path) -> dict[str, Any]:
    """rope_theta / partial_rotary_factor as config.json spells them (flat override at load can drop them)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    raw = raw.get("text_config", raw) if "rope_theta" not in raw and "rope_parameters" not in raw else raw
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    facts = {key: params.get(key, raw.get(key)) for key in _ROPE_FACTS}
    return {k: v for k, v in facts.items() if v is not None}


_ROPE_KEYS = ("rope_parameters", "rope_scaling")
_CARRIED_ROPE_KEYS = (*_ROPE_FACTS, "mrope_section", "mrope_interleaved")  # the checkpoint's, kept on replace


def _apply_nested_overrides(config: PretrainedConfig, nested: dict[str, dict]) -> None:
    """Dict-valued overrides. A rope dict goes to the config the language model reads
    (`get_text_config()`, the config itself for a plain LM); a sub-config is merged key by key."""
    for key, value in nested.items():
        if key in _ROPE_KEYS:
            _override_rope(config.get_text_config(), value, key)
            continue
        current = getattr(config, key, None)
        if isinstance(current, PretrainedConfig):
            for sub_key, sub_value in value.items():
                if sub_key in _ROPE_KEYS and isinstance(sub_value, dict):
                    _override_rope(current, sub_value, f"{key}.{sub_key}")
                else:
                    _set_override(current, sub_key, sub_value, f"{key}.{sub_key}")
            continue
        _set_override(config, key, dict(value), key)


def _set_override(config: PretrainedConfig, key: str, value: Any, where: str) -> None:
    """setattr, with a strict config's type check reported as a UserInputError naming `where`."""
    try:
        setattr(config, key, value)
    except (StrictDataclassError, TypeError) as exc:
        raise _override_error(exc, {where: value}, type(config).__name__, type(config)) from None


def _override_error(exc: Exception, overrides: dict[str, Any], what: str, cls: type | None) -> UserInputError:
    """A one-line error for overrides transformers refused: the key, its value and the field's type when
    the error names a field (huggingface_hub's strict dataclasses do), else all `overrides` and the cause."""
    cause = str(exc.__cause__ or exc).strip().splitlines()[-1].strip()
    field = re.search(r"field '(\w+)'", str(exc))
    key = next((k for k in overrides if field and k.rsplit(".", 1)[-1] == field.group(1)), None)
    if key is None:
        return UserInputError(f"hf_overrides {overrides!r} do not fit {what}: {cause}")
    types = {f.name: f.type for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    expected = types.get(field.group(1))
    expected = getattr(expected, "__name__", None) or str(expected).replace("transformers.modeling_rope_utils.", "")
    detail = f"expected {expected}" if field.group(1) in types else cause
    return UserInputError(f"hf_overrides {key}={overrides[key]!r} does not fit {what}: {detail}")


def _config_class(config_json: Path) -> type | None:
    """The transformers config class of config.json's model_type (None when unknown)."""
    try:
        return CONFIG_MAPPING[json.loads(config_json.read_text())["model_type"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


_KNOWN_EXTRA_KEYS = ("rope_scaling", "rope_theta", "torch_dtype", "quantization_config")  # read by getattr


def _warn_unknown_keys(config: PretrainedConfig, overrides: dict[str, Any], config_json: Path) -> None:
    """Warn about override keys that the config class does not declare and config.json does not hold:
    transformers stores any key, so a misspelt one would otherwise do nothing, silently."""
    if not dataclasses.is_dataclass(config):  # a remote-code or pre-v5 config: no field list to check
        return
    try:
        in_json = set(json.loads(config_json.read_text()))
    except (OSError, ValueError):
        in_json = set()
    known = {f.name for f in dataclasses.fields(config)} | set(config.attribute_map) | in_json
    unknown = [k for k in overrides if k not in known and k not in _KNOWN_EXTRA_KEYS and not hasattr(type(config), k)]
    if unknown:
        logger.warning("hf_overrides key(s) %s are not fields of %s: they are set on the config, but the model may "
                       "never read them (a misspelt key?)", ", ".join(map(repr, unknown)), type(config).__name__)


def _override_rope(config: PretrainedConfig, value: dict[str, Any], where: str) -> None:
    """Replace `config.rope_parameters` by `value`, keeping the checkpoint's model facts (theta,
    partial rotary factor, mrope sections) unless `value` sets them. ValueError: no rope_type."""
    _require_rope_type(value, where)
    current = getattr(config, "rope_parameters", None)
    config.rope_parameters = _carry_rope_facts(current, value) if isinstance(current, dict) else dict(value)


def _require_rope_type(value: dict[str, Any], where: str) -> None:
    """transformers reads a rope dict without rope_type as 'default' and ignores its scaling keys:
    an override that sets scaling keys without a type would do nothing, so it is an error."""
    if is_nested_rope_parameters(value):
        for layer_type, params in value.items():
            if isinstance(params, dict):
                _require_rope_type(params, f"{where}[{layer_type!r}]")
        return
    scaling = sorted(set(value) - set(_CARRIED_ROPE_KEYS))
    if value.get("rope_type") is None and value.get("type") is None and scaling:
        raise UserInputError(
            f"hf_overrides {where}={value!r} sets {scaling} but 'rope_type' is missing; without it "
            "transformers reads the dict as rope_type='default' and ignores them. Add 'rope_type' "
            f"({', '.join(SUPPORTED_ROPE_TYPES)})"
        )


def _carry_rope_facts(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A replacing rope_parameters dict keeps the model's rope_theta / partial_rotary_factor and
    mrope_section / mrope_interleaved unless it sets them."""
    new = dict(new)
    if old and "rope_type" not in old and all(isinstance(v, dict) for v in old.values()):
        return new  # per-layer-type form: replaced as given
    for key in _CARRIED_ROPE_KEYS:
        if key not in new and old.get(key) is not None:
            new[key] = old[key]
    return new


def _normalize_config_rope(config: PretrainedConfig, fallback: dict[str, Any], forced: dict[str, Any]) -> None:
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        return
    if is_nested_rope_parameters(params):
        config.rope_parameters = {
            layer_type: _normalize_one(p, fallback, forced) if isinstance(p, dict) else p
            for layer_type, p in params.items()
        }
    else:
        config.rope_parameters = _normalize_one(params, fallback, forced)


def _normalize_one(params: dict[str, Any], fallback: dict[str, Any], forced: dict[str, Any]) -> dict[str, Any]:
    params = {k: v for k, v in params.items() if v is not None or k not in _ROPE_FACTS}
    params.update(forced)
    return normalize_rope_parameters(params, fallback.get("rope_theta"), fallback.get("partial_rotary_factor"))


def is_nested_rope_parameters(params: dict[str, Any]) -> bool:
    """True for transformers' per-layer-type form ({"full_attention": {...}, "sliding_attention": {...}})."""
    return bool(params) and "rope_type" not in params and all(isinstance(v, dict) or v is None for v in params.values())


def get_rope_parameters(text_config: PretrainedConfig) -> tuple[dict[str, Any], dict[str, dict] | None]:
    """(flat rope parameters, per-layer-type dicts or None). For the nested form the flat one is
    the "full_attention" entry (else the first). Always has rope_type and rope_theta."""
    params = getattr(text_config, "rope_parameters", None) or {}
    if is_nested_rope_parameters(params):
        by_layer = {k: normalize_rope_parameters(v) for k, v in params.items() if isinstance(v, dict)}
        main = by_layer.get("full_attention") or next(iter(by_layer.values()), {})
        return normalize_rope_parameters(main), by_layer
    return normalize_rope_parameters(params, getattr(text_config, "rope_theta", None)), None


def check_rope_parameters(text_config: PretrainedConfig, head_dim: int) -> None:
    """Validate every rope dict of the config (fxrewrite.layers.rope_init.validate_rope_parameters)."""
    flat, by_layer = get_rope_parameters(text_config)
    max_position = getattr(text_config, "max_position_embeddings", None)
    for params in (by_layer or {"": flat}).values():
        validate_rope_parameters(params, head_dim, max_position)


def derive_max_model_len(
    text_config: PretrainedConfig,
    tokenizer_model_max_length: int | None = None,
    disable_sliding_window: bool = False,
) -> tuple[int, str]:
    """The longest context the config supports, and a description of where it came from.

    Minimum over MAX_LEN_KEYS present in the config, times rope `factor` except for llama3 and longrope (already
    scaled), from `original_max_position_embeddings` for yarn; per-layer-type rope (Gemma 3) is not scaled: its
    max_position_embeddings is already the scaled length. Then the sliding window when `disable_sliding_window`, and
    the tokenizer's model_max_length, which RoPE scaling does not lift (vLLM's order)."""
    derived, key = float("inf"), None
    for name in MAX_LEN_KEYS:
        value = getattr(text_config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < derived:
            derived, key = value, name
    offset = learned_position_offset(text_config) if key == "max_position_embeddings" else 0
    if offset:  # RoBERTa: 514 table entries, positions from padding_idx + 1
        derived, key = derived - offset, f"max_position_embeddings - padding offset {offset}"
    if derived == float("inf"):
        logger.warning("config names no context length (%s); using %d", ", ".join(MAX_LEN_KEYS), _DEFAULT_MAX_MODEL_LEN)
        derived, key = _DEFAULT_MAX_MODEL_LEN, "default"
    rope, by_layer = get_rope_parameters(text_config)
    if by_layer is None and rope["rope_type"] not in ("default", "llama3", "longrope"):
        factor = rope.get("factor") or 1.0
        if rope["rope_type"] == "yarn":
            derived, key = rope["original_max_position_embeddings"], "original_max_position_embeddings"
        key = f"{key}={derived} * rope factor {factor}"
        derived = derived * factor
    else:
        key = f"{key}={derived}"
    sliding_window = getattr(text_config, "sliding_window", None)
    if disable_sliding_window and isinstance(sliding_window, int) and sliding_window < derived:
        derived, key = sliding_window, f"sliding_window={sliding_window}"
    if tokenizer_model_max_length is not None and tokenizer_model_max_length < derived:
        derived, key = tokenizer_model_max_length, f"tokenizer model_max_length={tokenizer_model_max_length}"
    return int(derived), key


def verify_max_model_len(max_model_len: int | None, derived: int, key: str, model_len: int | None = None) -> int:
    """Return `max_model_len` (the derived length when None) after checking it against `derived`.

    Raises ValueError when it exceeds `derived`, unless FXREWRITE_ALLOW_LONG_MAX_MODEL_LEN=1 or
    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, which log and warn instead. `model_len`: the model config's own limit
    (`derive_max_model_len` without the tokenizer), which the warning names when only the tokenizer's is passed.
    """
    if max_model_len is None:
        return derived
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len <= 0:
        raise UserInputError(f"max_model_len must be a positive int, got {max_model_len!r}")
    if max_model_len <= derived:
        return max_model_len
    msg = (
        f"max_model_len={max_model_len} is greater than the derived max_model_len={derived} "
        f"(from {'the tokenizer config' if key.startswith('tokenizer ') else 'the model config'}: "
        f"{key.removeprefix('tokenizer ')})."
    )
    if any(os.environ.get(name, "").strip().lower() in ("1", "true") for name in ALLOW_LONG_ENV_VARS):
        limit = model_len if model_len is not None and key.startswith("tokenizer ") else derived
        risk = (f"the model config's own positions reach {limit} (only the tokenizer's limit is passed)"
                if max_model_len <= limit else
                f"positions past {limit} give NaN or garbage with RoPE and out-of-range indices with absolute "
                "position embeddings")
        warnings.warn(f"{msg} Proceeding because {ALLOW_LONG_ENV_VARS[0]}=1: {risk}.", UserWarning, stacklevel=3)
        return max_model_len  # a warning only: a log line too would print the same news twice
    # scaling RoPE extends the model's positions, not a limit the tokenizer config sets
    advice = ", or scale RoPE (hf_overrides rope_parameters) to extend the context"
    if key.startswith("tokenizer ") and model_len is not None and max_model_len <= model_len:
        advice = (f" (a limit of the tokenizer config, which scaling RoPE does not lift; the model config's own "
                  f"positions reach {model_len})")
    elif key.startswith("tokenizer "):
        advice = " (past the model config's own limit, scale RoPE too: hf_overrides rope_parameters)"
    raise UserInputError(
        f"{msg} Set {ALLOW_LONG_ENV_VARS[0]}=1 (or VLLM_ALLOW_LONG_MAX_MODEL_LEN=1) to allow it anyway{advice}."
    )
