"""ModelConfig: what the engine needs to know about a model, with vLLM's field names."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.model_files.config_checks import check_model_dimensions, config_json_values
from fxrewrite.runtime.model_files.hf_config import (
    HfOverrides,
    check_rope_parameters,
    derive_max_model_len,
    get_rope_parameters,
    load_hf_config,
    verify_max_model_len,
)
from fxrewrite.runtime.model_files.default_model import DEFAULT_MODEL
from fxrewrite.runtime.model_files.folders import resolve_model_path

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)
_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
}
_AUTO_FALLBACK_DTYPE = torch.float32  # what transformers computes in when config.json names no dtype


def resolve_dtype(dtype: str | torch.dtype, hf_config: PretrainedConfig) -> torch.dtype:
    """"auto" -> the config's dtype (a config file's `torch_dtype` loads as `dtype`) when float16/bfloat16/float32, else float32;
    a name in bfloat16/float16/half/float32/float or one of those torch.dtypes as given.

    Raises ValueError for anything else.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
    elif isinstance(dtype, str):
        name = dtype.lower().removeprefix("torch.")
        if name == "auto":
            return _config_dtype(hf_config)
        if name in _DTYPES:
            return _DTYPES[name]
    raise UserInputError(
        f"dtype must be 'auto', one of {', '.join(_DTYPES)} or the matching torch.dtype, got {dtype!r}"
    )


def _config_dtype(hf_config: PretrainedConfig) -> torch.dtype:
    unusable = None
    for config in (hf_config, hf_config.get_text_config()):
        given = getattr(config, "dtype", None)  # not `torch_dtype`: a deprecated alias that warns on read
        value = _DTYPES.get(given.removeprefix("torch.")) if isinstance(given, str) else given
        if value in _DTYPES.values():
            return value
        unusable = unusable or given
    if unusable is not None:  # e.g. "int8" (hf_overrides): no compute dtype; say which one is used instead
        logger.warning("the config's dtype %r is not one the model can compute in (%s): dtype='auto' uses %s; "
                       "pass dtype (--dtype) to choose", str(unusable), ", ".join(_DTYPES),
                       str(_AUTO_FALLBACK_DTYPE).removeprefix("torch."))
    return _AUTO_FALLBACK_DTYPE


def _tokenizer_model_max_length(tokenizer_path: Path) -> int | None:
    """model_max_length from tokenizer_config.json, ignoring transformers' 'unset' huge value."""
    try:
        value = json.loads((tokenizer_path / "tokenizer_config.json").read_text()).get("model_max_length")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(value, (int, float)) and 0 < value < 1e12:
        return int(value)
    return None


@dataclass
class ModelConfig:
    """A loaded model's configuration (after hf_overrides), as the engine and the server read it.

    Build it with `ModelConfig.from_pretrained`. Lengths are in tokens.
    """

    model: str
    """What the user passed: a local folder, a hub id or a .gguf file."""
    model_path: Path
    """Local folder holding config.json (and weights)."""
    tokenizer: str
    """Tokenizer folder or id (defaults to model_path)."""
    hf_config: PretrainedConfig
    """transformers config after hf_overrides."""
    hf_text_config: PretrainedConfig
    """The text sub-config (`hf_config.get_text_config()`), or hf_config itself."""
    architectures: list[str]
    dtype: torch.dtype
    max_model_len: int
    """Longest sequence (prompt + output tokens) the engine accepts."""
    derived_max_model_len: int
    """The config's own limit (see hf_config.derive_max_model_len)."""
    rope_parameters: dict[str, Any]
    """Normalised flat rope dict (always rope_type and rope_theta); for per-layer-type configs the
    full_attention entry."""
    head_dim: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rope_parameters_by_layer_type: dict[str, dict[str, Any]] | None = None
    """Per-layer-type rope dicts (Gemma 3 style), normalised; None for the flat form."""
    revision: str | None = None
    trust_remote_code: bool = False

    @property
    def cache_head_dim(self) -> int:
        """Width of one cached key (and value) head, in elements: the wider of the keys' (`head_dim`, or for
        multi-head latent attention, DeepSeek-V2/V3, whose `head_dim` is the rotary part, `qk_head_dim` =
        `qk_nope_head_dim + qk_rope_head_dim`) and the values' (`v_head_dim` where the config has one: MLA,
        MiMo-V2-Flash); the narrower side is zero-padded to it (`runtime.worker.attention`)."""
        text = self.hf_text_config
        keys = getattr(text, "qk_head_dim", None) or self.head_dim
        return max(keys, getattr(text, "v_head_dim", None) or 0)

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path | None,
        *,
        hf_overrides: HfOverrides = None,
        max_model_len: int | None = None,
        dtype: str | torch.dtype = "auto",
        tokenizer: str | Path | None = None,
        revision: str | None = None,
        download_dir: str | None = None,
        trust_remote_code: bool = False,
        disable_sliding_window: bool = False,
    ) -> ModelConfig:
        """Load `model`'s config, apply `hf_overrides`, check rope and max_model_len.

        `model`: local folder, hub id, .gguf file, or None for the default model (resolved by
        model_files.resolve_model_path, as is `tokenizer` when given; a hub id's files are read from and downloaded
        into `download_dir`, vLLM's hub cache folder, when given). A `max_model_len` key in `hf_overrides` (a dict,
        JSON object text, or callable(config) -> config, see hf_config) is used when `max_model_len` is None.
        Raises FileNotFoundError (no model), ValueError (bad overrides: not a JSON object, a value of the
        wrong type, a dimension that is not a positive int or does not divide (config_checks); dtype, rope
        parameters, a max_model_len above the derived one without FXREWRITE_ALLOW_LONG_MAX_MODEL_LEN=1),
        TypeError (overrides of the wrong kind): `fxrewrite.errors.UserInputError`s naming key and value.
        """
        model_path = resolve_model_path(model, revision=revision, download_dir=download_dir)
        hf_config, override_len = load_hf_config(model_path, hf_overrides, revision, trust_remote_code)
        text_config = hf_config.get_text_config()
        check_model_dimensions(text_config, config_json_values(model_path, text_config is not hf_config))
        torch_dtype = resolve_dtype(dtype, hf_config)
        head_dim = _head_dim(text_config)
        check_rope_parameters(text_config, head_dim)
        rope_parameters, by_layer = get_rope_parameters(text_config)
        tokenizer_path = str(model_path if tokenizer is None else
                             resolve_model_path(tokenizer, what="tokenizer", download_dir=download_dir))
        derived, key = derive_max_model_len(text_config, _tokenizer_model_max_length(Path(tokenizer_path)),
                                            disable_sliding_window)
        user_len = max_model_len if max_model_len is not None else override_len
        num_heads = text_config.num_attention_heads
        return cls(
            model=str(model) if model is not None else _default_model_id(),
            model_path=model_path,
            tokenizer=tokenizer_path,
            hf_config=hf_config,
            hf_text_config=text_config,
            architectures=list(getattr(hf_config, "architectures", None) or []),
            dtype=torch_dtype,
            max_model_len=verify_max_model_len(user_len, derived, key,
                                               derive_max_model_len(text_config, None, disable_sliding_window)[0]),
            derived_max_model_len=derived,
            rope_parameters=rope_parameters,
            head_dim=head_dim,
            hidden_size=text_config.hidden_size,
            num_hidden_layers=text_config.num_hidden_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(text_config, "num_key_value_heads", None) or num_heads,
            vocab_size=text_config.vocab_size,
            rope_parameters_by_layer_type=by_layer,
            revision=revision,
            trust_remote_code=trust_remote_code,
        )


def _head_dim(text_config: PretrainedConfig) -> int:
    return getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads


def _default_model_id() -> str:
    return DEFAULT_MODEL
