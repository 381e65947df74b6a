"""Quantized checkpoints and load-time quantization: which method, which layers, when to convert.

Two ways in, as in vLLM:
- an FP8 checkpoint: ``config.json`` has ``quantization_config`` with ``quant_method: "fp8"``,
  ``weight_block_size: [128, 128]`` and ``activation_scheme: "dynamic"`` (Qwen3-*-FP8, DeepSeek-V3):
  the linear layers become FP8 layers before the weights are read, and load the ``weight`` (e4m3)
  and ``weight_scale_inv`` tensors;
- ``quantization="fp8"`` (``--quantization fp8``) on a bf16/fp16/fp32 checkpoint: the weights load as
  usual and are then quantized per output channel (one scale per row, in the same [N, G] scale layout,
  so the same kernels run, plus torch's row-wise scaled matmul, which the load-time tuner may choose).
  A model built from an FP8 checkpoint's config without reading it (dummy weights) is FP8 from the start
  (`fill_dummy_weights`): an FP8 checkpoint's layout, blocks and memory, never its bf16 weights.
Any other ``quant_method`` (awq, gptq, bitsandbytes...) is a ValueError before a weight is read.

After loading, on a device without FP8 tensor cores (a CPU, a GPU older than sm_89) the FP8 weights
are dequantized to the compute dtype, so the model computes with exactly the values the checkpoint
encodes. Which linears: every `fxrewrite.layers.linear` layer and plain `nn.Linear` except the LM head, MoE
routers and the ``modules_to_not_convert`` / ``ignored_layers`` patterns of the quantization config.
MoE experts in an FP8 checkpoint are dequantized as they load (`fp8_experts`): the fused MoE kernels
compute in the model's dtype.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
from torch import nn

from fxrewrite.errors import UserInputError
from fxrewrite.layers.fp8_linear import (
    FP8_DTYPE,
    FP8_MAX,
    SCALE_NAME,
    as_linear_base,
    convert_linear_to_fp8,
    dequantize_fp8_layer,
    fp8_gemm_supported,
    prepare_fp8_layers_for_gpu,
    quantize_fp8_layer,
)
from fxrewrite.layers.fused_moe import FusedMoE
from fxrewrite.layers.linear import LinearBase
from fxrewrite.runtime.model_files.dense_mlp import dense_mlp_width
from fxrewrite.weights import SHARDS_ATTR, FusedAway

QUANTIZATION_METHODS = ("fp8",)
"""Values `quantization=` accepts (and checkpoint quant_methods the loader reads)."""
DEFAULT_BLOCK = (128, 128)


@dataclass
class Fp8Config:
    """What the loader needs: block shape [rows, cols], whether the checkpoint itself holds FP8 tensors,
    and module-name patterns that stay in high precision."""

    weight_block_size: tuple[int, int] = DEFAULT_BLOCK
    is_checkpoint_fp8: bool = False
    modules_to_not_convert: tuple[str, ...] = ()


def _as_dict(qc) -> dict:
    if isinstance(qc, dict):
        return qc
    if hasattr(qc, "to_dict") or (hasattr(qc, "__dict__") and not isinstance(qc, type)):  # transformers' config object
        return qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    raise UserInputError(f"the model's quantization_config is {qc!r}; expected an object such as "
                         '{"quant_method": "fp8", "weight_block_size": [128, 128]}')


def resolve_quantization(quantization: str | None, hf_config) -> Fp8Config | None:
    """The quantization to apply, from `quantization=` and the config's ``quantization_config``.

    Raises ValueError naming an unsupported `quant_method` / `quantization` value and the supported
    ones, a non-dynamic activation scheme, or a malformed ``weight_block_size``. Reads no weights.
    """
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise UserInputError(f"quantization={quantization!r} is not supported; supported: {list(QUANTIZATION_METHODS)}")
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return Fp8Config() if quantization == "fp8" else None
    qc = _as_dict(qc)
    method = qc.get("quant_method")
    if method not in QUANTIZATION_METHODS:
        raise UserInputError(f"the checkpoint's quantization_config has quant_method={method!r}, which this engine "
                         f"cannot load; supported: {list(QUANTIZATION_METHODS)} (block-scaled FP8 checkpoints)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise UserInputError(f"FP8 activation_scheme={qc.get('activation_scheme')!r} is not supported; "
                         "only 'dynamic' (per-token-group scales computed at run time)")
    block = qc.get("weight_block_size")
    if block is None:
        raise UserInputError("FP8 checkpoints without weight_block_size (per-tensor scales) are not supported; "
                         "expected weight_block_size [128, 128]")
    if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise UserInputError(f"weight_block_size={block!r} must be two positive integers, e.g. [128, 128]")
    skip = _patterns(qc, "modules_to_not_convert") + _patterns(qc, "ignored_layers")
    return Fp8Config(tuple(block), True, skip)


def _patterns(qc: dict, key: str) -> tuple[str, ...]:
    """A module-name pattern list of the quantization config; one string is one pattern (not its characters)."""
    value = qc.get(key) or ()
    value = (value,) if isinstance(value, str) else value
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise UserInputError(f"quantization_config {key}={qc.get(key)!r} must be a list of module-name patterns")
    return tuple(value)


def check_fp8_checkpoint_tensors(quant: Fp8Config | None, model_path) -> None:
    """UserInputError, before any worker starts, when the config declares an FP8 checkpoint (e.g. a
    ``quantization_config`` given through hf_overrides) but the weight files hold no ``*_scale_inv`` tensor:
    the weights are not FP8. Reads only the files' headers."""
    from safetensors import safe_open

    from fxrewrite.runtime.model_files.loader import checkpoint_files

    if quant is None or not quant.is_checkpoint_fp8:
        return
    for file in checkpoint_files(model_path):
        with safe_open(str(file), framework="pt") as f:
            if any(name.endswith("_scale_inv") for name in f.keys()):
                return
    raise UserInputError(f"the config declares an FP8 checkpoint (quantization_config quant_method 'fp8', "
                         f"weight_block_size {list(quant.weight_block_size)}) but the weights in {model_path} have no "
                         "*_scale_inv tensors: they are not FP8. To quantize float weights at load pass "
                         "quantization='fp8' (--quantization fp8); for random FP8 weights of this shape use "
                         "load_format='dummy' (--load-format dummy)")


def check_fp8_tensor_parallel(quant: Fp8Config | None, text_config, tp_size: int) -> None:
    """UserInputError, before any worker starts, when an FP8 checkpoint's column blocks do not tile a row-parallel
    layer's share of its input (`_row_parallel_inputs`): each rank would start mid-block in the checkpoint's scale grid.
    The layers check themselves too (`check_fp8_shapes`); this names the config value first. Weights quantized at load
    (``quantization="fp8"``) need no alignment."""
    if quant is None or not quant.is_checkpoint_fp8 or tp_size <= 1:
        return
    block = quant.weight_block_size[1]
    for layer, (size, what) in _row_parallel_inputs(text_config).items():
        if size % tp_size == 0 and (size // tp_size) % block:
            raise UserInputError(
                f"{layer}: {what} = {size} input columns over tensor_parallel_size={tp_size} gives {size // tp_size} "
                f"per rank, not a multiple of the checkpoint's FP8 block width {block} (weight_block_size="
                f"{list(quant.weight_block_size)}); use a tensor_parallel_size that keeps whole blocks")


def _row_parallel_inputs(text_config) -> dict[str, tuple[int, str]]:
    """The FP8 row-parallel layers' input widths: o_proj (heads x head_dim); a dense MLP's down_proj (intermediate_size,
    where a decoder layer holds one: `dense_mlp_width`; Mixtral's and OLMoE's is their experts' width, and experts are
    dequantized at load); Qwen2-MoE's shared expert's down_proj (shared_expert_intermediate_size)."""
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    inputs = {"o_proj": (heads * head_dim, f"num_attention_heads x head_dim = {heads} x {head_dim}")}
    experts = any(getattr(text_config, key, None) for key in ("num_experts", "num_local_experts"))
    if not experts:
        dense = text_config.intermediate_size
    else:
        has_moe_width = getattr(text_config, "moe_intermediate_size", None) is not None
        dense = dense_mlp_width(text_config) if has_moe_width else None
    if isinstance(dense, int) and dense:
        inputs["down_proj"] = (dense, "intermediate_size")
    shared = getattr(text_config, "shared_expert_intermediate_size", None)
    if experts and isinstance(shared, int) and shared:
        inputs["shared_expert.down_proj"] = (shared, "shared_expert_intermediate_size")
    return inputs


def _targets(model: nn.Module, quant: Fp8Config):
    """(parent, child name, qualified name, module) for every linear to quantize."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for prefix, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{prefix}.{child_name}" if prefix else child_name
            if child is head or child_name == "lm_head" or not isinstance(child, (nn.Linear, LinearBase)) \
                    or isinstance(child, FusedAway):  # the placeholder of a projection the fusion took in
                continue
            if _is_router(parent, child_name):  # MoE routers stay in high precision, as FP8 checkpoints ship them
                continue
            if _ignored(name, quant):
                continue
            parts = _checkpoint_parts(model, parent, child_name, prefix)
            kept = [part for part in parts if _ignored(part, quant)]
            if kept and len(kept) < len(parts):
                raise UserInputError(f"quantization_config's modules_to_not_convert / ignored_layers keep {kept} in "
                                     f"high precision but not {[p for p in parts if p not in kept]}; the fused layer "
                                     f"{name} holds them all, so they must all be FP8 or all not")
            if not kept:
                yield parent, child_name, name, child


def _ignored(name: str, quant: Fp8Config) -> bool:
    return any(fnmatch.fnmatch(name, f"*{p}*") for p in quant.modules_to_not_convert)


def _checkpoint_parts(model: nn.Module, parent: nn.Module, child_name: str, prefix: str) -> list[str]:
    """The checkpoint's module names a fused layer stands for (q_proj / k_proj / v_proj of a qkv_proj, gate_proj /
    up_proj of a gate_up_proj): the rewrite's shard table, or a native model's ``packed_modules_mapping``."""
    def join(n: str) -> str:
        return f"{prefix}.{n}" if prefix else n

    for new, olds in parent.__dict__.get(SHARDS_ATTR, ()):
        if new == child_name:
            return [join(old) for old, _ in olds]
    packed = getattr(model, "packed_modules_mapping", None) or {}
    return [join(part.strip(".")) for part, (fused, _) in packed.items() if fused.strip(".") == child_name]


def _is_router(parent: nn.Module, child_name: str) -> bool:
    return isinstance(parent, FusedMoE) and parent.names.get("router") == child_name


def prepare_fp8_model(model: nn.Module, quant: Fp8Config | None) -> None:
    """Before loading an FP8 checkpoint (or filling dummy weights in its layout): turn the target linears into FP8
    layers (parameters stay where they are, e.g. meta). No-op unless the checkpoint holds FP8 tensors."""
    if quant is None or not quant.is_checkpoint_fp8:
        return
    for parent, child_name, name, child in _targets(_inner(model), quant):
        setattr(parent, child_name, convert_linear_to_fp8(as_linear_base(child), name, quant.weight_block_size))


DUMMY_STD = 0.02
"""Standard deviation of load_format='dummy' weights (transformers' default initializer_range)."""
_DUMMY_CHUNK_BYTES = 64 << 20


def fill_dummy_weights(model: nn.Module) -> None:
    """Random weights in place (load_format='dummy'): every parameter normal(0, DUMMY_STD) in its own dtype, except an
    FP8 layer's: its e4m3 weight standard normal (clamped to the e4m3 range) and every scale DUMMY_STD, so the
    dequantized weights have the same spread while the layer keeps an FP8 checkpoint's layout and memory. The FP8
    weights are drawn in row chunks of at most _DUMMY_CHUNK_BYTES of float32."""
    for name, param in model.named_parameters():
        if param.dtype == FP8_DTYPE:
            rows = max(1, _DUMMY_CHUNK_BYTES // (4 * max(1, param[0].numel())))
            for start in range(0, param.shape[0], rows):
                chunk = param.data[start:start + rows]
                chunk.copy_(torch.randn(chunk.shape, device=chunk.device).clamp_(-FP8_MAX, FP8_MAX))
        elif name.rsplit(".", 1)[-1] == SCALE_NAME:
            param.data.fill_(DUMMY_STD)
        else:
            param.data.normal_(0.0, DUMMY_STD)


def finish_fp8_model(model: nn.Module, quant: Fp8Config | None, dtype: torch.dtype, device: torch.device) -> None:
    """After loading: quantize still high-precision target linears (``quantization="fp8"``, dummy
    weights), then on an FP8 GPU pick the GEMM backends, else dequantize everything to `dtype`."""
    if quant is None:
        return
    inner = _inner(model)
    for parent, child_name, name, child in _targets(inner, quant):
        if child.weight.dtype != torch.float8_e4m3fn:
            setattr(parent, child_name, quantize_fp8_layer(as_linear_base(child), name, quant.weight_block_size,
                                                           per_channel=not quant.is_checkpoint_fp8))
    if fp8_gemm_supported(device):
        prepare_fp8_layers_for_gpu(inner, device, dtype)  # scale layout + per-M backend choice
        return
    for module in inner.modules():
        if isinstance(module, LinearBase):
            dequantize_fp8_layer(module, dtype)


def _inner(model: nn.Module) -> nn.Module:
    """The HF model inside the engine's transformers wrapper (names as in the checkpoint), else the model."""
    return getattr(model, "hf_model", model)
