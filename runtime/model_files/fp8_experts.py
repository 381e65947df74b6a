"""FP8 mixture-of-experts checkpoints: expert weights dequantized while they stream in.

Qwen3-30B-A3B-FP8, Qwen3-235B-A22B-FP8 and DeepSeek-style FP8 folders store every expert projection as
float8_e4m3fn ``...experts.N.gate_proj.weight`` with a float32 ``...weight_scale_inv`` per 128 x 128 block
(transformers 5's fused 3-D ``experts.gate_up_proj`` / ``experts.down_proj`` likewise, with scales of one
more leading dim). The fused MoE layer computes in the model's dtype, so each (weight, scale) pair is
replaced by weight * scale of its block (float32; the parameter's copy rounds it to the compute dtype,
as `fxrewrite.layers.fp8_linear.dequantize_fp8_layer` does for dense layers on devices without FP8)
before transformers' checkpoint conversion fuses the experts. Dense FP8 projections are untouched: they
stay FP8 layers. At most one expert tensor waits for its partner (files list a weight beside its scale).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from fxrewrite.errors import UserInputError
from fxrewrite.layers.fp8_linear import FP8_DTYPE, dequantize_weight_fp8
from fxrewrite.sharding import LazySlice

SCALE_SUFFIX = "_scale_inv"
_EXPERT = re.compile(r"\.experts\.")


def dequantize_fp8_experts(weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) -> the same stream with each FP8 expert weight and its ``_scale_inv`` (one scale per
    `block` = [rows, cols] of the weight, the config's ``weight_block_size``) replaced by one float32
    dequantized weight under the weight's name. ValueError naming a tensor whose partner is missing (an
    FP8 expert weight without scales would load as raw e4m3 values) or whose scales do not tile it."""
    waiting: dict[str, tuple[str, torch.Tensor]] = {}  # weight name -> (name of the arrived one, tensor)
    for name, tensor in weights:
        if not _EXPERT.search(name) or not (name.endswith(SCALE_SUFFIX) or _is_fp8(tensor)):
            yield name, tensor
            continue
        key = name.removesuffix(SCALE_SUFFIX)
        if key not in waiting:
            waiting[key] = (name, tensor)
            continue
        other_name, other = waiting.pop(key)
        weight, scale = (other, tensor) if name.endswith(SCALE_SUFFIX) else (tensor, other)
        try:
            dequantized = dequantize_weight_fp8(_read(weight), _read(scale), block, key)
        except ValueError as e:  # scales that do not tile the weight: the checkpoint's fault, one line in the CLI
            raise UserInputError(str(e)) from None
        yield key, dequantized
    if waiting:
        name = next(iter(waiting.values()))[0]
        raise UserInputError(f"FP8 expert tensor {name!r} has no partner "
                         f"({'weight' if name.endswith(SCALE_SUFFIX) else SCALE_SUFFIX}) in the checkpoint")


def _is_fp8(tensor) -> bool:
    if isinstance(tensor, LazySlice):  # a tensor-parallel rank's lazy read: the file header has the dtype
        return tensor.dtype_name() == "F8_E4M3"
    return tensor.dtype == FP8_DTYPE


def _read(tensor) -> torch.Tensor:
    return tensor.materialize() if isinstance(tensor, LazySlice) else tensor
