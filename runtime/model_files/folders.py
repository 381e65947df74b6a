"""Where a model's files are: `resolve_model_path(model) -> Path` (a local Hugging Face folder).

`model` may be a local folder (returned as is), a `.gguf` file (converted once into a cached
folder, `gguf_convert`), the default model's id (`default_model.DEFAULT_MODEL`: the HF cache's
snapshot when it holds one, else the folder built from the installed GGUF), or a hub id
`org/name` (`huggingface_hub.snapshot_download` of the config, tokenizer, safetensors and
generation_config files; the HF cache first, the network only when `HF_HUB_OFFLINE` is unset). `download_dir`
(vLLM's `--download-dir`) is that cache's folder instead of the default one (`HF_HUB_CACHE`), for hub ids only.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from fxrewrite.errors import UserFileNotFoundError, UserInputError, UserTypeError
from fxrewrite.runtime.model_files.default_model import DEFAULT_MODEL, default_model_path
from fxrewrite.runtime.model_files.gguf_convert import convert_gguf

# Files a causal LM needs: configs, tokenizers (fast, sentencepiece, BPE, tiktoken), templates,
# safetensors weights and their index. No .bin/.pt/.msgpack/.h5/.onnx copies of the weights.
ALLOW_PATTERNS = [
    "*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.py",
]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_TRUE = {"1", "true", "yes", "on"}


def resolve_model_path(model: str | os.PathLike | None, *, revision: str | None = None, what: str = "model",
                       download_dir: str | os.PathLike | None = None) -> Path:
    """The local folder holding `model`'s config, tokenizer and weights.

    `model`: a local folder; a `.gguf` file; `DEFAULT_MODEL` or None (the built-in default);
    or a hub id `org/name` (at `revision`). Raises FileNotFoundError naming `model` when a path
    does not exist, a model folder has no config.json, or a hub id is neither in the HF cache nor
    downloadable; ValueError naming it when it is an existing file that is not `.gguf`, or neither a
    path nor a hub id; TypeError
    for other types. `what`: the argument the errors name ("model", "tokenizer"). `download_dir`: the hub cache
    folder a hub id is read from and downloaded into (huggingface_hub's `cache_dir`; None: the default cache).
    """
    if model is None:
        model = DEFAULT_MODEL
    if not isinstance(model, (str, os.PathLike)):
        raise UserTypeError(f"{what} must be a path or a hub id string, got {type(model).__name__}: {model!r}")
    text = os.fspath(model)
    if not text.strip():
        raise UserInputError(f"{what} must be a folder, a .gguf file or a hub id, got {text!r}")
    path = Path(text).expanduser()
    if path.is_dir():
        if what == "model" and not (path / "config.json").is_file():  # else transformers' "Unrecognized model"
            raise UserFileNotFoundError(f"model {text!r} is a folder without a config.json; expected a model folder "
                                        "(config.json, weights, a tokenizer), a .gguf file or a hub id")
        return path
    if path.suffix == ".gguf":
        return convert_gguf(path)  # FileNotFoundError naming the file when missing
    if path.exists():
        raise UserInputError(f"{what} {text!r} is a file; expected a {what} folder, a .gguf file or a hub id")
    if text == DEFAULT_MODEL:
        return _default_model_folder(revision, download_dir)
    if not is_hub_id(text):
        raise UserFileNotFoundError(f"{what} {text!r} is not an existing folder or .gguf file (nor a hub id 'org/name')")
    return download_hub_model(text, revision=revision, what=what, cache_dir=download_dir)


def read_json_object(path: Path) -> dict:
    """A model folder's JSON file (generation_config.json...) as a dict; UserInputError naming the file when it is not
    JSON text or holds something other than an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserInputError(f"{path} is not valid JSON text: {e}") from None
    if not isinstance(data, dict):
        raise UserInputError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def is_hub_id(text: str) -> bool:
    """True for `org/name` strings (one slash, no leading `.`, `/` or `~`)."""
    return bool(_HUB_ID.match(text))


def hub_offline() -> bool:
    """True when `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) is set: read now, not at import."""
    return any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def download_hub_model(repo_id: str, *, revision: str | None = None, what: str = "model",
                       cache_dir: str | os.PathLike | None = None) -> Path:
    """`repo_id`'s snapshot folder: from the HF cache (`cache_dir`, else the default one), else (unless offline)
    the hub, downloaded into it. Raises FileNotFoundError naming `repo_id` (and `cache_dir`) when neither has it."""
    from huggingface_hub import snapshot_download

    attempts = [True] if hub_offline() else [True, False]
    reason: Exception | None = None
    for local_only in attempts:
        try:
            folder = snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                       local_files_only=local_only, cache_dir=cache_dir)
        except Exception as e:  # hub errors, HFValidationError, connection errors: all mean "not here"
            reason = e
            continue
        if (Path(folder) / "config.json").is_file():
            return Path(folder)
        reason = FileNotFoundError(f"no config.json in {folder}")
    cache = "the HF cache" if cache_dir is None else f"the HF cache at download_dir {os.fspath(cache_dir)!r}"
    where = f"in {cache} (HF_HUB_OFFLINE is set)" if hub_offline() else f"in {cache} nor on the hub"
    raise UserFileNotFoundError(
        f"{what} {repo_id!r} is not a local folder, and its files are not {where}: "
        f"{type(reason).__name__}: {str(reason).splitlines()[0] if str(reason) else ''}"
    ) from reason


def _default_model_folder(revision: str | None, cache_dir: str | os.PathLike | None = None) -> Path:
    """The default model: the HF cache's real snapshot when present, else the local build."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(DEFAULT_MODEL, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                        local_files_only=True, cache_dir=cache_dir))
        if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
            return folder
    except Exception:  # not cached: the usual case on machines without the hub
        pass
    return default_model_path()
