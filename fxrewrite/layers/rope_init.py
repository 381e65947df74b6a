"""RoPE inverse frequencies and attention factor per `rope_type`.

Reproduces the math of transformers' `ROPE_INIT_FUNCTIONS` (transformers.modeling_rope_utils) and
of the models' own `compute_default_rope_parameters`, op for op in float32, so that cos/sin built
from these frequencies equal transformers' bit for bit. Nothing here calls transformers.

`rope_parameters` is transformers v5's flat dict (`rope_type`, `rope_theta`, `factor`, ...).
`normalize_rope_parameters` turns legacy spellings into it; `validate_rope_parameters` checks it
with errors that name the rope_type and the bad key.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from fxrewrite.errors import UserInputError

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope", "proportional")
"""Every rope_type that `compute_inv_freq` and `get_rope` implement."""

DEFAULT_ROPE_THETA = 10000.0


class RopeConfigWarning(UserWarning):
    """A rope parameter is legal but probably not what the model was trained with."""


def normalize_rope_parameters(
    rope_parameters: dict[str, Any] | None,
    rope_theta: float | None = None,
    partial_rotary_factor: float | None = None,
) -> dict[str, Any]:
    """Return a new flat dict that always has `rope_type` and `rope_theta`.

    Accepts the legacy `rope_scaling` spelling (`type` instead of `rope_type`, "su" for longrope,
    "mrope" for default) and fills `rope_theta` / `partial_rotary_factor` from the given fallbacks
    (a legacy top-level `rope_theta`), then `DEFAULT_ROPE_THETA`.
    """
    params = dict(rope_parameters or {})
    legacy_type = params.pop("type", None)
    rope_type = params.get("rope_type") or legacy_type or "default"
    rope_type = {"su": "longrope", "mrope": "default"}.get(rope_type, rope_type)
    params["rope_type"] = rope_type
    if params.get("rope_theta") is None:
        params["rope_theta"] = float(rope_theta) if rope_theta is not None else DEFAULT_ROPE_THETA
    if partial_rotary_factor is not None:
        params.setdefault("partial_rotary_factor", partial_rotary_factor)
    return params


def get_rotary_dim(head_size: int, rope_parameters: dict[str, Any]) -> int:
    """Number of rotated channels per head: int(head_size * partial_rotary_factor), as transformers; the whole head
    for "proportional" rope, whose unrotated channels are pairs of frequency zero (`_proportional`)."""
    if rope_parameters.get("rope_type") == "proportional":
        return head_size
    partial_rotary_factor = rope_parameters.get("partial_rotary_factor") or 1.0
    return int(head_size * partial_rotary_factor)


def _require(rope_parameters: dict[str, Any], *keys: str) -> None:
    rope_type = rope_parameters["rope_type"]
    for key in keys:
        if rope_parameters.get(key) is None:
            raise UserInputError(
                f"rope_parameters for rope_type={rope_type!r} need {key!r}, which is missing "
                f"(got keys {sorted(rope_parameters)})"
            )


def _check_positive_number(rope_parameters: dict[str, Any], key: str, minimum: float = 0.0) -> None:
    value = rope_parameters.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise UserInputError(
            f"rope_parameters[{key!r}] for rope_type={rope_parameters['rope_type']!r} must be a number "
            f">= {minimum}, got {value!r}"
        )


def validate_rope_parameters(
    rope_parameters: dict[str, Any], head_size: int, max_position_embeddings: int | None = None
) -> None:
    """Check a normalised flat `rope_parameters` dict for `head_size`-wide heads.

    Raises ValueError naming the rope_type and the missing or bad key: an unknown rope_type (the
    message lists SUPPORTED_ROPE_TYPES), `factor` < 1, yarn without factor or
    original_max_position_embeddings, llama3 without factor / low_freq_factor / high_freq_factor /
    original_max_position_embeddings, longrope short/long_factor not of length rotary_dim // 2.
    Warns (RopeConfigWarning) when a yarn `original_max_position_embeddings` is larger than the model's
    `max_position_embeddings` (likely a typo; smaller is normal, e.g. Qwen3's YaRN recipe).
    """
    rope_type = rope_parameters.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UserInputError(
            f"unknown rope_type {rope_type!r}; supported rope types are {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    _require(rope_parameters, "rope_theta")
    _check_positive_number(rope_parameters, "rope_theta", minimum=1e-12)
    _check_positive_number(rope_parameters, "factor", minimum=1.0)
    _check_positive_number(rope_parameters, "attention_factor")
    partial = rope_parameters.get("partial_rotary_factor", 1.0)
    if not isinstance(partial, (int, float)) or not 0.0 < partial <= 1.0:
        raise UserInputError(f"rope_parameters['partial_rotary_factor'] must be in (0, 1], got {partial!r}")
    if rope_type in ("linear", "dynamic"):
        _require(rope_parameters, "factor")
    elif rope_type == "yarn":
        _require(rope_parameters, "factor", "original_max_position_embeddings")
        for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            _check_positive_number(rope_parameters, key)
    elif rope_type == "llama3":
        _require(rope_parameters, "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if rope_parameters["high_freq_factor"] <= rope_parameters["low_freq_factor"]:
            raise UserInputError(
                "rope_parameters for rope_type='llama3' need high_freq_factor > low_freq_factor, got "
                f"high_freq_factor={rope_parameters['high_freq_factor']!r}, "
                f"low_freq_factor={rope_parameters['low_freq_factor']!r}"
            )
    elif rope_type == "longrope":
        _require(rope_parameters, "short_factor", "long_factor", "original_max_position_embeddings")
        _check_longrope_factors(rope_parameters, get_rotary_dim(head_size, rope_parameters))
    _warn_original_max_position(rope_parameters, max_position_embeddings)


def _check_longrope_factors(rope_parameters: dict[str, Any], rotary_dim: int) -> None:
    for key in ("short_factor", "long_factor"):
        value = rope_parameters[key]
        if not isinstance(value, (list, tuple)) or len(value) != rotary_dim // 2:
            length = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
            raise UserInputError(
                f"rope_parameters[{key!r}] for rope_type='longrope' must be a list of rotary_dim // 2 = "
                f"{rotary_dim // 2} numbers (head_dim * partial_rotary_factor / 2), got {length}"
            )


def _warn_original_max_position(rope_parameters: dict[str, Any], max_position_embeddings: int | None) -> None:
    """Warn when a yarn original_max_position_embeddings is longer than the model's own context.

    A shorter one is normal: Qwen3's documented YaRN recipe uses 32768 on a config whose
    max_position_embeddings is 40960, and llama3 / longrope / DeepSeek configs store the scaled
    length there. A longer one claims pretraining on positions the model does not have: likely a typo.
    """
    original = rope_parameters.get("original_max_position_embeddings")
    if rope_parameters["rope_type"] != "yarn" or original is None or max_position_embeddings is None:
        return
    if original <= max_position_embeddings:
        return
    warnings.warn(
        f"rope_parameters['original_max_position_embeddings']={original} is larger than the model's "
        f"max_position_embeddings={max_position_embeddings} (rope_type='yarn'); YaRN scales from the "
        "context length the model was pretrained with, which is usually at most max_position_embeddings: "
        "check the value",
        RopeConfigWarning,
        stacklevel=3,
    )


def _exponents(rotary_dim: int, device=None) -> torch.Tensor:
    # transformers: torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    return torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).to(torch.float) / rotary_dim


def _default(params: dict, dim: int, max_position_embeddings: int, seq_len, device) -> tuple[torch.Tensor, float]:
    return 1.0 / (params["rope_theta"] ** _exponents(dim, device)), 1.0


def _linear(params: dict, dim: int, max_position_embeddings: int, seq_len, device) -> tuple[torch.Tensor, float]:
    inv_freq = 1.0 / (params["rope_theta"] ** _exponents(dim, device))
    inv_freq /= params["factor"]
    return inv_freq, 1.0


def _proportional(params: dict, dim: int, max_position_embeddings: int, seq_len, device) -> tuple[torch.Tensor, float]:
    """Gemma 4 / LFM3: the first int(partial_rotary_factor * dim // 2) frequencies of a full-width (`dim` = head
    size) rotary, the rest zero (cos 1, sin 0: unrotated), all divided by `factor` (transformers'
    `_compute_proportional_rope_parameters`)."""
    angles = int((params.get("partial_rotary_factor") or 1.0) * dim // 2)
    inv_freq = torch.zeros(dim // 2, dtype=torch.float32, device=device)
    inv_freq[:angles] = 1.0 / (params["rope_theta"] ** _exponents(dim, device)[:angles])
    return inv_freq / (params.get("factor") or 1.0), 1.0


def _dynamic(params: dict, dim: int, max_position_embeddings: int, seq_len, device) -> tuple[torch.Tensor, float]:
    """NTK-aware base: theta * (factor * L / L0 - (factor - 1)) ** (d / (d - 2)), L = max(seq_len, L0).

    With a tensor `seq_len` the base is a float32 tensor, as in transformers' dynamic_rope_update; one
    of shape [..., 1] (a length per token) gives inv_freq [..., rotary_dim // 2].
    """
    factor = params["factor"]
    if seq_len is None:
        seq_len = max_position_embeddings
    elif isinstance(seq_len, torch.Tensor):  # clamp, not maximum(tensor(L0)): no host copy (CUDA graphs)
        seq_len = seq_len.clamp(min=max_position_embeddings)
    else:
        seq_len = max(seq_len, max_position_embeddings)
    base = params["rope_theta"] * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** _exponents(dim, device)), 1.0


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN attention temperature 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1); YaRN paper eq. 22."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(params: dict, factor: float) -> float:
    """Explicit attention_factor, else mscale(factor, mscale) / mscale(factor, mscale_all_dim), else mscale(factor)."""
    if params.get("attention_factor") is not None:
        return params["attention_factor"]
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
    return yarn_get_mscale(factor)


def _yarn_correction_range(params: dict, dim: int, base: float) -> tuple[float, float]:
    """Dimension range [low, high] between beta_fast and beta_slow rotations over the original length."""
    original = params["original_max_position_embeddings"]

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(params.get("beta_fast") or 32)
    high = correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn(params: dict, dim: int, max_position_embeddings: int, seq_len, device) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): ramp between interpolated and extrapolated frequencies."""
    base = params["rope_theta"]
    factor = params.get("factor")
    if factor is None:  # DeepSeek-style configs: the ratio of the two lengths
        factor = max_position_embeddings / params["original_max_position_embeddings"]
    attention_factor = yarn_attention_factor(params, factor)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    low, high = _yarn_correction_range(params, dim, base)
    if low == high:
        high += 0.001  # prevent a division by zero, as transformers does
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp.to(device=device, dtype=torch.float)
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq, attention_factor


def _llama3(params: dict, dim: int, max_position_embeddings: int, seq_len, device) -> tuple[torch.Tensor, float]:
    """Llama 3.1: divide long wavelengths by factor, keep short ones, blend in between."""
    inv_freq = 1.0 / (params["rope_theta"] ** _exponents(dim, device))
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def longrope_attention_factor(params: dict, max_position_embeddings: int) -> float:
    """Explicit attention_factor, else sqrt(1 + ln(factor) / ln(original)) (1 when factor <= 1)."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:  # Phi-3 configs: the ratio of the two lengths
        factor = max_position_embeddings / original
    if params.get("attention_factor") is not None:
        return params["attention_factor"]
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


def _longrope(params: dict, dim: int, max_position_embeddings: int, seq_len, device) -> tuple[torch.Tensor, float]:
    """LongRoPE: long_factor when seq_len > original_max_position_embeddings, else short_factor."""
    long = seq_len is not None and seq_len > params["original_max_position_embeddings"]
    ext_factors = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32, device=device)
    inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (ext_factors * params["rope_theta"] ** inv_freq_shape)
    return inv_freq, longrope_attention_factor(params, max_position_embeddings)


_INIT_FUNCTIONS: dict[str, Callable[..., tuple[torch.Tensor, float]]] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "llama3": _llama3,
    "longrope": _longrope,
    "proportional": _proportional,
}


def compute_inv_freq(
    rope_parameters: dict[str, Any],
    rotary_dim: int,
    max_position_embeddings: int,
    seq_len: int | torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies float32 [rotary_dim // 2] (radians per position) and the attention factor.

    `rope_parameters` is a normalised flat dict; `max_position_embeddings` is the model's own
    (dynamic NTK's reference length; longrope's factor when `factor` is absent); `seq_len` is the
    current length (dynamic: the NTK base grows with it; longrope: picks long_factor past
    original_max_position_embeddings). Formulas: transformers' ROPE_INIT_FUNCTIONS.
    Raises ValueError for an unknown rope_type.
    """
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type not in _INIT_FUNCTIONS:
        raise UserInputError(
            f"unknown rope_type {rope_type!r}; supported rope types are {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return _INIT_FUNCTIONS[rope_type](rope_parameters, rotary_dim, max_position_embeddings, seq_len, device)
