"""GGUF file -> cached Hugging Face folder (bf16 safetensors, tokenizer, chat template).

transformers reads GGUF through `from_pretrained(dir, gguf_file=...)` (needs the `gguf` and
`accelerate` packages) and dequantises every tensor, which takes tens of seconds on a CPU; so a
file is converted once into the cache (`fxrewrite.runtime.model_files.model_cache`) and the folder is what
the engine, the server and the tests load afterwards, the same as any downloaded checkpoint.
"""

from __future__ import annotations

import functools
import os
import struct
from contextlib import contextmanager
from pathlib import Path

from fxrewrite.errors import UserFileNotFoundError, UserInputError
from fxrewrite.runtime.model_files.model_cache import cached_build, file_key

# Bump when the conversion below changes, so that old cached folders are rebuilt.
CONVERTER_VERSION = 2
CHATML_END = "<|im_end|>"


def gguf_folder_name(gguf_file: str | os.PathLike) -> str:
    """Cache folder stem for a GGUF file: its name without `.gguf`, e.g. `SmolLM2-135M-Instruct.Q4_1`."""
    return Path(gguf_file).name.removesuffix(".gguf")


def convert_gguf(gguf_file: str | os.PathLike, *, name: str | None = None,
                 chat_template: str | None = None, tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """Convert `gguf_file` once into a cached Hugging Face folder and return the folder.

    `chat_template` is used when the GGUF file carries none; `tokenizer_dir`, when given, is a
    folder holding this file's tokenizer already converted (saves re-reading it from the GGUF).
    Raises FileNotFoundError naming the file when it does not exist, ValueError when it is not
    a `.gguf` file or does not start with the GGUF magic bytes.
    """
    path = Path(gguf_file).expanduser()
    if path.suffix != ".gguf":
        raise UserInputError(f"expected a .gguf file, got {str(gguf_file)!r}")
    if not path.is_file():
        raise UserFileNotFoundError(f"GGUF file {str(gguf_file)!r} does not exist")
    path = path.resolve()
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":  # the magic every GGUF file starts with (the gguf library raises a bare ValueError)
            raise UserInputError(f"{str(gguf_file)!r} does not start with the GGUF magic bytes: not a GGUF file")
    key = file_key(path, CONVERTER_VERSION)
    return cached_build(name or gguf_folder_name(path), key,
                        lambda out: write_hf_folder(path, out, chat_template=chat_template,
                                                    tokenizer_dir=tokenizer_dir),
                        info={"converter": CONVERTER_VERSION}, source=path)


def gguf_cache_key(gguf_file: str | os.PathLike) -> str:
    """The cache key `convert_gguf` uses for `gguf_file`: its content (`model_cache.file_key`) and the
    converter version, not its path (a copy in another virtual environment reuses the conversion)."""
    return file_key(Path(gguf_file).expanduser().resolve(), CONVERTER_VERSION)


def load_gguf_tokenizer(gguf_file: Path, *, chat_template: str | None = None, max_length: int | None = None):
    """The tokenizer of `gguf_file` with its ChatML eos fixed and `chat_template` filled in
    when the file carries none (a few seconds: transformers rebuilds the BPE from GGUF metadata)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    if tokenizer.chat_template is None and chat_template is not None:
        tokenizer.chat_template = chat_template
    fix_chatml_eos(tokenizer)
    for key in ("is_local", "local_files_only"):  # loading details, not tokenizer settings
        tokenizer.init_kwargs.pop(key, None)
    if max_length:  # GGUF tokenizers come out unlimited; the model's context is the real bound
        tokenizer.model_max_length = max_length
    return tokenizer


@contextmanager
def gguf_read_once():
    """While active, transformers' GGUF loading parses each file once and builds each tensor-name
    map once.

    transformers parses the whole GGUF (49k-entry tokenizer arrays included) once for the config,
    once for the weights and once for the tokenizer, and rebuilds gguf's tensor-name map for
    every module it visits (~400 times for a 30-layer Llama); together that is most of the
    conversion's CPU time. Both are pure functions of their arguments over a read-only memmap,
    so memoising them is safe. Patches `gguf.GGUFReader` / `gguf.get_tensor_name_map` (which
    transformers imports from `gguf` at call time) and restores them on exit; re-entrant.
    """
    import gguf

    if getattr(gguf.GGUFReader, "_fxrewrite_memo", False):  # already active (nested use)
        yield
        return
    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def cached_reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    cached_reader._fxrewrite_memo = True
    gguf.GGUFReader, gguf.get_tensor_name_map = cached_reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map
        readers.clear()


def write_hf_folder(gguf_file: Path, out: Path, *, chat_template: str | None = None,
                    tokenizer_dir: str | os.PathLike | None = None) -> None:
    """Load `gguf_file` with transformers and save it into `out` as a bf16 Hugging Face folder; UserInputError
    naming the file when transformers cannot read it (truncated, damaged, an architecture it does not convert)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with gguf_read_once():
        try:  # a truncated or damaged file passes the magic check and fails in the gguf reader, with no file name
            # float32 is transformers' fast path for GGUF dequantisation; cast to bf16 afterwards.
            model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                         dtype=torch.float32)
            max_len = getattr(model.config, "max_position_embeddings", None)
            if tokenizer_dir is not None:
                tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
            else:
                tokenizer = load_gguf_tokenizer(gguf_file, chat_template=chat_template, max_length=max_len)
        except (struct.error, ValueError, IndexError, KeyError, EOFError) as e:
            raise UserInputError(f"{str(gguf_file)!r} is not a readable GGUF file transformers supports: "
                                 f"{type(e).__name__}: {e}") from e
    _drop_quantization(model)
    model.to(torch.bfloat16)
    _sync_special_ids(model, tokenizer)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def fix_chatml_eos(tokenizer) -> None:
    """A ChatML model ends a turn with `<|im_end|>`; some GGUF tokenizers come out with
    `<|im_start|>` (or `<|endoftext|>`) as eos, which makes generation run past the answer."""
    template = tokenizer.chat_template or ""
    if CHATML_END in template and CHATML_END in tokenizer.get_vocab():
        tokenizer.eos_token = CHATML_END
        if tokenizer.pad_token is None:
            tokenizer.pad_token = CHATML_END


def _drop_quantization(model) -> None:
    # The weights are already dequantised; with the GGUF quantization_config still attached,
    # save_pretrained refuses ("not serializable") and from_pretrained would expect a GGUF file.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False


def _sync_special_ids(model, tokenizer) -> None:
    eos, bos, pad = tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = eos
        if bos is not None:
            cfg.bos_token_id = bos
        if pad is not None:
            cfg.pad_token_id = pad
