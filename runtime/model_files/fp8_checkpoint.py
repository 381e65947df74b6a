"""Write an FP8 block-quantized copy of a model folder, in the layout Qwen3-*-FP8 / DeepSeek-V3 ship.

The weight of every linear layer the FP8 loader quantizes (`fxrewrite.runtime.model_files.quantization`: each
``nn.Linear`` of the model but the LM head and MoE routers, whatever its name: q_proj, query_key_value, c_fc,
kv_a_proj_with_mqa, a shared expert's gate) and every per-expert projection of an MoE checkpoint (gate/up/down,
Mixtral's w1/w3/w2) becomes float8_e4m3fn with a float32 ``<name>_scale_inv`` of shape [ceil(N / 128),
ceil(K / 128)] (dequantized = fp8 * scale, scale = block amax / 448, as transformers' ``Fp8Quantize``); embeddings,
norms, routers and the LM head stay as they were; ``config.json`` gains ``quantization_config = {"quant_method":
"fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}``. The linear layers are read
off the model transformers builds from the folder's config (on the meta device: no weights); where it cannot build
one, the names decide (``*proj.weight`` in a decoder layer). Used by the tests and the FP8 demo (no FP8 checkpoint
can be downloaded here); ``python -m fxrewrite.runtime.model_files.fp8_checkpoint SRC DST``.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
from pathlib import Path

from torch import nn

from fxrewrite.errors import UserInputError
from fxrewrite.layers.fp8_linear import quantize_weight_fp8
from fxrewrite.runtime.model_files.loader import iterate_safetensors
from fxrewrite.runtime.model_files.model_cache import BUILD_INFO

logger = logging.getLogger(__name__)

_EXPERT = re.compile(r"\.experts\.\d+\.(\w*proj|w[123])\.weight$")  # one expert's projection in the checkpoint
_WEIGHT_FILE = re.compile(r"\.(safetensors|bin|pt|pth|ckpt|gguf|h5|msgpack)$|\.(safetensors|bin)\.index\.json$")
_ROUTERS = ("gate", "router")  # a router is a linear layer of these names in some models (routed experts' gate)


def is_quantized_name(name: str, tensor, linears: frozenset[str] | None = None) -> bool:
    """Whether checkpoint tensor `name` is quantized: 2-D, and the weight of one of `linears` (module names of the
    model's linear layers, `linear_layer_names`) or a per-expert projection; without `linears`, a decoder layer's
    ``*proj.weight`` or per-expert projection. MoE routers, norms, embeddings and the LM head are not."""
    if tensor.dim() != 2 or not name.endswith(".weight"):
        return False
    if _EXPERT.search(name):
        return True
    module = name[: -len(".weight")]
    if linears is not None:
        return module in linears
    return ".layers." in name and name.endswith("proj.weight")


def linear_layer_names(src: Path) -> frozenset[str] | None:
    """Module names of the ``nn.Linear`` layers of the causal LM transformers builds from `src`'s config (meta
    device), less the output embedding and routers (a last name part in `_ROUTERS`): what the FP8 loader quantizes.
    None (logged) when transformers cannot build it."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    except Exception as e:  # noqa: BLE001 - an architecture transformers cannot build: the names decide
        logger.warning("fp8_checkpoint: transformers cannot build %s (%s: %s); quantizing decoder *proj weights by "
                       "name", src, type(e).__name__, str(e)[:200])
        return None
    head = model.get_output_embeddings()
    return frozenset(name for name, m in model.named_modules()
                     if isinstance(m, nn.Linear) and m is not head and name.rsplit(".", 1)[-1] not in _ROUTERS)


def write_fp8_checkpoint(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    """Copy folder `src` to `dst` with its linear layers quantized (module docstring); returns `dst`. UserInputError,
    before `dst` is made, for a `src` that is not a model folder with safetensors, is already quantized, or is `dst`,
    and for a `dst` that is a file, cannot be made, or already holds a model's files (a config.json, weight files:
    another model's, or shards and an index a loader would read too). Every weight is read before `dst` is written.
    Weights go to ``dst/model.safetensors``.

    Non-safetensors files (tokenizer, generation config) are copied as they are.
    """
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    _check_folders(src, dst)
    tensors, linears = {}, linear_layer_names(src)
    for name, t in iterate_safetensors(src):  # all read before DST is touched: a bad SRC leaves nothing behind
        if is_quantized_name(name, t, linears):
            tensors[name], tensors[name + "_scale_inv"] = quantize_weight_fp8(t, block)
        else:
            tensors[name] = t.contiguous()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": list(block)}
    try:
        dst.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserInputError(f"fp8_checkpoint: cannot make DST {str(dst)!r}: {e.strerror}") from None
    for f in src.iterdir():  # tokenizer, generation config; not this project's cache record of SRC
        if f.is_file() and f.suffix != ".safetensors" and f.name not in (
                "config.json", "model.safetensors.index.json", BUILD_INFO):
            shutil.copy2(f, dst / f.name)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


def _check_folders(src: Path, dst: Path) -> None:
    """UserInputError for the folders `write_fp8_checkpoint` refuses (its docstring)."""
    if not (src / "config.json").is_file() or not any(src.glob("*.safetensors")):
        raise UserInputError(f"fp8_checkpoint: SRC {str(src)!r} must be a model folder with config.json and "
                             "*.safetensors weights")
    if dst.exists() and not dst.is_dir():
        raise UserInputError(f"fp8_checkpoint: DST {str(dst)!r} exists and is not a folder")
    if dst.exists() and dst.resolve() == src.resolve():
        raise UserInputError(f"fp8_checkpoint: DST {str(dst)!r} is SRC; write the FP8 copy to another folder")
    model = sorted(f.name for f in (dst.iterdir() if dst.is_dir() else ())
                   if _WEIGHT_FILE.search(f.name) or f.name == "config.json")
    if model:  # another model's, or shards and an index a loader would read beside the new weights
        raise UserInputError(f"fp8_checkpoint: DST {str(dst)!r} already holds a model's files ({', '.join(model[:3])}"
                             f"{', ...' if len(model) > 3 else ''}); remove them or write to an empty folder")
    if "quantization_config" in json.loads((src / "config.json").read_text()):
        raise UserInputError(f"fp8_checkpoint: SRC {str(src)!r} is already quantized (its config.json has a "
                             "quantization_config)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fxrewrite.runtime.model_files.fp8_checkpoint",
                                description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, help="model folder with safetensors weights")
    p.add_argument("dst", type=Path, help="output folder")
    args = p.parse_args(argv)
    try:
        print(write_fp8_checkpoint(args.src, args.dst))
    except UserInputError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
