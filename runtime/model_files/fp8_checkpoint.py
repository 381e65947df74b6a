"""Write an FP8 block-quantized copy of a model folder, in the layout Qwen3-*-FP8 / DeepSeek-V3 ship.

Every 2-D ``*proj.weight`` of a decoder layer becomes float8_e4m3fn with a float32
``<name>_scale_inv`` of shape [ceil(N / 128), ceil(K / 128)] (dequantized = fp8 * scale, scale =
block amax / 448, as transformers' ``Fp8Quantize``); embeddings, norms and the LM head stay as they
were; ``config.json`` gains ``quantization_config = {"quant_method": "fp8", "activation_scheme":
"dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}``. Used by the tests and the FP8 demo (no
FP8 checkpoint can be downloaded here); ``python -m fxrewrite.runtime.model_files.fp8_checkpoint SRC DST``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from fxrewrite.errors import UserInputError
from fxrewrite.layers.fp8_linear import quantize_weight_fp8
from fxrewrite.runtime.model_files.loader import iterate_safetensors


_MIXTRAL_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


def is_quantized_name(name: str, tensor) -> bool:
    """Decoder-layer projection weights (attention q/k/v/o, MLP and expert gate/up/down, Mixtral's expert
    w1/w3/w2) are quantized; routers, norms, embeddings and the LM head are not."""
    projection = name.endswith("proj.weight") or _MIXTRAL_EXPERT.search(name) is not None
    return ".layers." in name and projection and tensor.dim() == 2


def write_fp8_checkpoint(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    """Copy folder `src` to `dst` with its decoder projections quantized; returns `dst`. UserInputError, before
    `dst` is made, for a `src` that is not a model folder with safetensors, is already quantized, or is `dst`, and
    for a `dst` that is a file. Weights go to ``dst/model.safetensors``, which loaders read before any other
    ``*.safetensors`` file left in `dst`.

    Non-safetensors files (tokenizer, generation config) are copied as they are.
    """
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file() or not any(src.glob("*.safetensors")):
        raise UserInputError(f"fp8_checkpoint: SRC {str(src)!r} must be a model folder with config.json and "
                             "*.safetensors weights")
    if dst.exists() and not dst.is_dir():
        raise UserInputError(f"fp8_checkpoint: DST {str(dst)!r} exists and is not a folder")
    if dst.exists() and dst.resolve() == src.resolve():
        raise UserInputError(f"fp8_checkpoint: DST {str(dst)!r} is SRC; write the FP8 copy to another folder")
    if "quantization_config" in json.loads((src / "config.json").read_text()):
        raise UserInputError(f"fp8_checkpoint: SRC {str(src)!r} is already quantized (its config.json has a "
                             "quantization_config)")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    tensors = {}
    for name, t in iterate_safetensors(src):
        if is_quantized_name(name, t):
            tensors[name], tensors[name + "_scale_inv"] = quantize_weight_fp8(t, block)
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


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
