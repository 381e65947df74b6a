"""Default sampling values from a model's generation_config.json (vLLM's `--generation-config`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fxrewrite.errors import UserFileNotFoundError, UserInputError
from fxrewrite.runtime.model_files.folders import read_json_object

# generation_config.json key -> request / SamplingParams field (the keys vLLM takes over).
_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_generation_defaults(model_path: str | Path, generation_config: str = "auto") -> dict[str, Any]:
    """Sampling defaults that a request's own values override.

    generation_config: "auto" reads `<model_path>/generation_config.json` when present; "vllm"
    uses none; any other value is a folder that must hold a generation_config.json.
    Raises UserFileNotFoundError (a FileNotFoundError) for a folder without one, UserInputError (a ValueError)
    for a file that is not a JSON object or holds a value SamplingParams refuses (a negative temperature, say):
    the command line shows either as one line.
    """
    if generation_config == "vllm":
        return {}
    folder = Path(model_path) if generation_config == "auto" else Path(generation_config)
    path = folder / "generation_config.json"
    if not path.is_file():
        if generation_config == "auto":
            return {}
        raise UserFileNotFoundError(f"generation_config={generation_config!r} (--generation-config): no "
                                    f"generation_config.json in {folder} (expected 'auto', 'vllm' or a folder "
                                    "holding one)")
    data = read_json_object(path)
    defaults = {field: data[key] for key, field in _KEYS.items() if data.get(key) is not None}
    from fxrewrite.runtime.engine.sampling_params import SamplingParams

    try:  # the values every request without its own would get: refused here, not blamed on each request
        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:  # named as the file names it (max_new_tokens, not SamplingParams' max_tokens)
        message = str(e).replace("max_tokens=", "max_new_tokens=") if "max_tokens" in defaults else str(e)
        raise UserInputError(f"{path}: {message}") from None
    return defaults


def check_generation_config(generation_config: str) -> None:
    """Fail before a model loads when --generation-config names a folder (not "auto" / "vllm") whose
    generation_config.json is missing or not a JSON object (the errors of `load_generation_defaults`)."""
    if generation_config not in ("auto", "vllm"):
        load_generation_defaults("", generation_config)
