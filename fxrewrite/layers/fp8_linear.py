"""FP8 linear layers: block-quantized float8_e4m3fn weights, dynamic per-token-group activation scales.

A post-hoc transform of a built model (gpt-fast's ``quantize.py`` shape): `convert_linear_to_fp8`
turns one of our linear layers (`fxrewrite.layers.linear`, fused or tensor-parallel) into its FP8
twin in place: ``weight`` becomes float8_e4m3fn and a float32 ``weight_scale_inv`` parameter appears,
both with a ``weight_loader`` that takes the checkpoint's tensors (``weight_scale_inv`` is
``[ceil(N / 128), ceil(K / 128)]``, dequantized = fp8 * scale, the DeepSeek-V3 / Qwen3-FP8 layout).

In memory the scale is kept expanded along the output dimension, one row per weight row
(``[N_per_partition, ceil(K_per_partition / 128)]``): the layer's own weight loader then shards and
fuses the scales exactly as it does the weight (q/k/v heads, gate/up parts, TP rows), and a part or
shard that does not start on a 128-row boundary keeps the right scale for every row. The input
dimension is the accumulation dimension of the GEMM, so a row-parallel shard of K must be a whole
number of blocks: a ValueError names the tensor and the sizes otherwise.

`dequantize_fp8_layer` turns the layer back into a plain one in the compute dtype (CPUs and GPUs
without FP8 tensor cores); `quantize_fp8_layer` quantizes a loaded high-precision weight (vLLM's
``quantization="fp8"`` on a bf16 checkpoint): per output channel (one scale per row, stored in the
same [N, G] layout with equal columns, so the group kernels run unchanged and the row-wise scaled
matmul reads column 0; ``weight_per_channel`` marks such a layer), or in blocks when asked.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from fxrewrite.distributed import all_reduce_tp_shards
from fxrewrite.kernels import env_choice, fp8_dispatch, fp8_tune, gemv_dispatch, use_triton
from fxrewrite.kernels.fp8_gemm import FP8_DTYPE, FP8_MAX
from fxrewrite.kernels.fp8_quant_fused import rms_norm_quant_fp8, silu_and_mul_quant_fp8
from fxrewrite.kernels.skinny_gemv import GEMV_MAX_M
from fxrewrite.layers.activation import SiluAndMul
from fxrewrite.layers.linear import (
    PENDING_NORM_ATTR,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

SCALE_NAME = "weight_scale_inv"
logger = logging.getLogger(__name__)
_fused_quant_failed: list[str] = []
"""The error of the first fused-quantization kernel that raised (outside a capture): from then on the
separate quantization runs. FXREWRITE_FP8_FUSED_QUANT=0 turns the fused producers off from the start."""


def _fused_producer(fn, *args):
    """fn(*args) (a `fxrewrite.kernels.fp8_quant_fused` kernel), or None after it raised outside a CUDA-graph
    capture (logged once; the caller runs the unfused path)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - fail closed: the separate kernels compute the same values
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise
        _fused_quant_failed.append(f"{type(e).__name__}: {str(e)[:200]}")
        logger.warning("fused FP8 activation quantization failed (%s); the separate kernels run from now on",
                       _fused_quant_failed[0])
        return None


class Fp8LinearMixin:
    """Forward of an FP8 layer: x [..., K_part] -> [..., N_part] in x's dtype (row-parallel: all-reduced)."""

    weight_block_size: tuple[int, int]
    weight_per_channel: bool = False
    weight_scale_rows: int = 1
    weight_source_dtype: torch.dtype = torch.float32
    """Rows of ``weight_scale_inv`` equal in aligned runs of this many (block-scaled; `_scale_rows`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """At decode token counts the FP8 skinny GEMV where its load-time timing chose it (`gemv_dispatch`),
        else the FP8 GEMM the FP8 tuner chose (`fp8_dispatch`). A QKV layer's pending input norm
        (`PENDING_NORM_ATTR`, as `QKVParallelLinear.forward` takes it) is applied first, through `norm_forward`."""
        norm = self.__dict__.pop(PENDING_NORM_ATTR, None) if PENDING_NORM_ATTR in self.__dict__ else None
        if norm is not None:
            return self.norm_forward(x, norm)[0]
        if self.weight.dtype != FP8_DTYPE:  # dequantized (CPU): the plain layer's forward
            return super().forward(x)
        scales = self._gemv_operands()
        config = gemv_dispatch.config_for_call("linear", x, self.weight, **scales) if scales else None
        if config is not None:
            k = x.shape[-1]
            out = gemv_dispatch.run(x.reshape(-1, k), self.weight, None, config, **scales).view(*x.shape[:-1], -1)
        else:
            out = fp8_dispatch.fp8_linear_dispatch(x, self.weight, self.weight_scale_inv, self.weight_block_size[1],
                                                   per_channel=self.weight_per_channel,
                                                   scale_rows=self.weight_scale_rows)
        return self._finish(out)

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        if isinstance(self, RowParallelLinear) and self.tp_size > 1 and self.reduce_results:
            all_reduce_tp_shards(out)
        return out if self.bias is None else out + self.bias

    def _input_quantization(self, x: torch.Tensor):
        """(backend, activation group size) when the GEMM this call runs reads FP8 activations and the
        producing kernel should write them (`fp8_dispatch.input_quantization`); None at decode token counts
        (the skinny GEMV's and the weight-only GEMV's), on a CPU, under torch.compile or autograd."""
        if self.weight.dtype != FP8_DTYPE or self.weight_block_size[1] != 128 or not use_triton(x):
            return None
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and x.requires_grad) or _fused_quant_failed:
            return None
        if env_choice("FXREWRITE_FP8_FUSED_QUANT", "1", ("1", "0")) == "0":
            return None
        m = x.numel() // x.shape[-1]
        if m <= GEMV_MAX_M:
            return None
        return fp8_dispatch.input_quantization(self.weight.shape[0], self.weight.shape[1], m, self.weight_per_channel)

    def _quantized_product(self, q, s, form, dtype) -> torch.Tensor | None:
        out = fp8_dispatch.run_quantized(q, s, self.weight, self.weight_scale_inv, dtype, form[0],
                                         self.weight_per_channel)
        return None if out is None else self._finish(out)

    def norm_forward(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None = None):
        """`LinearBase.norm_forward`; above decode token counts, when the chosen GEMM reads FP8 activations,
        the RMSNorm kernel writes them (`rms_norm_quant_fp8`: no bf16 normalized tensor, no quantization pass)."""
        form = self._input_quantization(x)
        fusable = getattr(norm, "offset", None) == 0.0 and getattr(norm, "upcast", False)
        if form is None or not fusable or (residual is not None and residual.shape != x.shape):
            return super().norm_forward(x, norm, residual)
        k = x.shape[-1]
        res2 = residual.reshape(-1, k) if residual is not None else None
        fused = _fused_producer(rms_norm_quant_fp8, x.reshape(-1, k).contiguous(), norm.weight,
                                norm.variance_epsilon, None if res2 is None else res2.contiguous(), form[1])
        out = None if fused is None else self._quantized_product(fused[0], fused[1], form, x.dtype)
        if out is None:  # a kernel failed (the GEMM backend was demoted): the unfused path
            return super().norm_forward(x, norm, residual)
        return out.view(*x.shape[:-1], -1), (fused[2].view(x.shape) if residual is not None else x)

    def silu_forward(self, x: torch.Tensor, act: nn.Module, out_residual: torch.Tensor | None = None) -> torch.Tensor:
        """`LinearBase.silu_forward` (at decode token counts out_residual is added in the FP8 skinny GEMV's
        epilogue where it runs); above them, when the chosen GEMM reads FP8 activations, the SiLU-and-mul kernel
        writes them (`silu_and_mul_quant_fp8`) and out_residual is added by torch after the GEMM."""
        form = self._input_quantization(x[..., : x.shape[-1] // 2])
        if form is None or type(act) is not SiluAndMul or x.shape[-1] != 2 * self.weight.shape[1]:
            return super().silu_forward(x, act, out_residual)
        fused = _fused_producer(silu_and_mul_quant_fp8, x.reshape(-1, x.shape[-1]).contiguous(), form[1])
        out = None if fused is None else self._quantized_product(fused[0], fused[1], form, x.dtype)
        if out is None:
            return super().silu_forward(x, act, out_residual)
        out = out.view(*x.shape[:-1], -1)
        return out if out_residual is None else out_residual + out

    def _gemv_operands(self) -> dict | None:
        """FP8 weights with 128-column scale groups: the skinny GEMV's w_scale / per_channel arguments."""
        if self.weight.dtype != FP8_DTYPE:  # dequantized: the plain product
            return {}
        if self.weight_block_size[1] != 128:
            return None
        return {"w_scale": self.weight_scale_inv, "per_channel": self.weight_per_channel}

    def _plain_forward(self) -> bool:
        return self.weight.dtype != FP8_DTYPE  # dequantized: super().forward is the plain product


_CLASSES: dict[type, type] = {}


def _fp8_class(cls: type) -> type:
    if issubclass(cls, Fp8LinearMixin):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Fp8{cls.__name__}", (Fp8LinearMixin, cls), {"__module__": __name__})
    return _CLASSES[cls]


def as_linear_base(module: nn.Module) -> LinearBase:
    """A plain `nn.Linear` as a `ReplicatedLinear` with the same parameters (meta stays meta)."""
    if isinstance(module, LinearBase):
        return module
    w = module.weight
    new = ReplicatedLinear(module.in_features, module.out_features, bias=module.bias is not None,
                           params_dtype=w.dtype, device=w.device)
    if w.device.type != "meta":
        with torch.no_grad():
            new.weight.copy_(w)
            if module.bias is not None:
                new.bias.copy_(module.bias)
    return new


def _full_rows(layer: LinearBase, shard_id) -> int:
    """Rows of the checkpoint tensor that `shard_id` of this layer loads (the unsharded part)."""
    if isinstance(layer, QKVParallelLinear):  # checkpoint heads: kv heads replicated over ranks count once
        heads = {None: layer.total_num_heads + 2 * layer.total_num_kv_heads, "q": layer.total_num_heads}
        return heads.get(shard_id, layer.total_num_kv_heads) * layer.head_size
    if isinstance(layer, MergedColumnParallelLinear) and shard_id is not None:
        return layer.output_sizes[shard_id]
    return layer.output_size


def check_fp8_shapes(layer: LinearBase, name: str, block: tuple[int, int]) -> None:
    """ValueError when this rank's share of the input dim is not a whole number of `block[1]` groups."""
    k_part, k = layer.input_size_per_partition, layer.input_size
    if layer.tp_size > 1 and k_part != k and k_part % block[1] != 0:
        raise ValueError(f"{name}.weight: input size {k} split over tensor_parallel_size={layer.tp_size} gives "
                         f"{k_part} columns per rank, not a multiple of the FP8 block size {block[1]} "
                         f"(weight_block_size={list(block)}); use a tensor_parallel_size that keeps whole blocks")


def _scale_loader(layer: LinearBase, name: str):
    """weight_loader of the expanded scale: checkpoint [ceil(N/bn), ceil(K/bk)] -> rows repeated bn times."""
    bn, bk = layer.weight_block_size

    def load(param: nn.Parameter, loaded: torch.Tensor, loaded_shard_id=None) -> None:
        loaded = loaded.materialize() if hasattr(loaded, "materialize") else loaded
        rows = _full_rows(layer, loaded_shard_id)
        want = (-(-rows // bn), -(-layer.input_size // bk))
        if tuple(loaded.shape) != want:
            raise ValueError(f"{name}.{SCALE_NAME} (shard {loaded_shard_id!r}) has shape {tuple(loaded.shape)}; "
                             f"a [{rows}, {layer.input_size}] weight with weight_block_size [{bn}, {bk}] "
                             f"needs {list(want)}")
        expanded = loaded.float().repeat_interleave(bn, dim=0)[:rows]
        type(layer).weight_loader(layer, param, expanded, loaded_shard_id)

    return load


def _weight_loader(layer: LinearBase, name: str):
    """The layer's weight_loader, refusing integer tensors (an FP8 weight saved as int8 / uint8 bytes would be cast
    value by value into e4m3: other numbers, silently). ValueError naming the tensor."""
    def load(param: nn.Parameter, loaded: torch.Tensor, loaded_shard_id=None) -> None:
        tag = loaded.dtype_name() if hasattr(loaded, "dtype_name") else None  # a lazy safetensors slice: no read
        integer = tag == "BOOL" or tag[0] in "IU" if tag else not loaded.dtype.is_floating_point
        if integer:
            raise ValueError(f"{name}.weight (shard {loaded_shard_id!r}) is stored as {tag or loaded.dtype}; an FP8 "
                             "checkpoint's weight must be float8_e4m3fn (or another float type), not integers")
        type(layer).weight_loader(layer, param, loaded, loaded_shard_id)

    return load


def convert_linear_to_fp8(layer: LinearBase, name: str, block: tuple[int, int],
                          checkpoint_blocks: bool = True) -> LinearBase:
    """Make `layer` (on meta or a device) an FP8 layer awaiting checkpoint tensors; returns it.

    weight -> empty float8_e4m3fn [N_part, K_part]; new ``weight_scale_inv`` float32 [N_part, ceil(K_part/bk)].
    `name` (the module's qualified name) only labels errors. `checkpoint_blocks`: the scales will come from a
    checkpoint's global block grid, so this rank's columns must start on a block (check_fp8_shapes, ValueError);
    weights quantized at load are scaled over this rank's own columns and need no such alignment.
    """
    if checkpoint_blocks:
        check_fp8_shapes(layer, name, block)
    layer.__class__ = _fp8_class(type(layer))
    layer.weight_block_size = tuple(block)
    layer.weight_source_dtype = layer.weight.dtype  # the model's dtype: a weight sync rounds to it, as loading did
    layer.weight_scale_rows = _scale_rows(layer, block[0])
    w = layer.weight
    weight = nn.Parameter(torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device), requires_grad=False)
    weight.weight_loader = _weight_loader(layer, name)
    layer.weight = weight
    groups = -(-layer.input_size_per_partition // block[1])
    scale = nn.Parameter(torch.empty(w.shape[0], groups, dtype=torch.float32, device=w.device), requires_grad=False)
    scale.weight_loader = _scale_loader(layer, name)
    layer.register_parameter(SCALE_NAME, scale)
    return layer


def quantize_weight_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (fp8 [N, K], checkpoint-layout scales float32 [ceil(N/bn), ceil(K/bk)]).

    scale = amax of the block / 448 (1 for an all-zero block), as transformers' ``Fp8Quantize``.
    """
    bn, bk = block
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    wf = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n)).view(nb, bn, kb, bk)
    amax = wf.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nb * bn, kb * bk)[:n, :k]
    return q.to(FP8_DTYPE).contiguous(), scale


def dequantize_weight_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str = "weight"
                          ) -> torch.Tensor:
    """fp8 [..., N, K] and scales float32 [..., ceil(N/bn), ceil(K/bk)] of `block` = (bn, bk) blocks -> float32
    [..., N, K] = fp8 * its block's scale (the inverse of `quantize_weight_fp8`; leading dims, e.g. experts,
    carried along; the last row / column of blocks may be partial). ValueError naming `name` and both
    shapes when the scale grid does not match."""
    (n, k), (bn, bk) = q.shape[-2:], block
    want = (*q.shape[:-2], -(-n // bn), -(-k // bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}: FP8 scales of shape {tuple(scale.shape)} do not match weight {tuple(q.shape)} in "
                         f"{bn} x {bk} blocks (expected {want})")
    full = scale.float().repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., :n, :k]
    return q.float() * full


def quantize_weight_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (fp8 [N, K], scales float32 [N]): scale = amax of the row / 448 (1 for an
    all-zero row), dequantized = fp8 * scale (the per-channel scheme of vLLM's ``channel`` strategy)."""
    amax = w.float().abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE).contiguous(), scale


def _scale_rows(layer: LinearBase, block_rows: int) -> int:
    """The aligned run of rows that share one scale row in the expanded scales: every fused part (q / k / v,
    gate / up) and tensor-parallel shard starts a block of its own tensor, at a multiple of its size on this
    rank, so gcd(block rows, every part's size on this rank) rows from row 0 lie in one block."""
    sizes = getattr(layer, "output_sizes_per_partition", None)
    if sizes is None:
        sizes = layer.output_sizes if isinstance(layer, QKVParallelLinear) else [layer.output_size_per_partition]
    return math.gcd(block_rows, *sizes)


def quantize_fp8_layer(layer: LinearBase, name: str, block: tuple[int, int], per_channel: bool = False) -> LinearBase:
    """Quantize a loaded layer's weight in place, over this rank's (fused, sharded) weight, so the
    scales line up with its rows; returns the FP8 layer. per_channel: one scale per output row (the
    stored [N, ceil(K/block[1])] scales repeat it along the groups), else `block` blocks."""
    w = layer.weight.detach()
    convert_linear_to_fp8(layer, name, block, checkpoint_blocks=False)
    layer.weight_per_channel = per_channel
    requantize_fp8_layer(layer, w)
    return layer


def requantize_fp8_layer(layer: LinearBase, w: torch.Tensor, rows: list[tuple[int, int]] | None = None) -> None:
    """Store the float weight `w` [N_part, K_part] (this rank's fused rows) in the FP8 layer, in place, quantized as
    `quantize_fp8_layer` does (per output row when ``weight_per_channel``, else `weight_block_size` blocks from the
    first row of each range): e4m3 weight and expanded scales, or on a layer dequantized for the CPU
    (`dequantize_fp8_layer`) the dequantized values. `rows`: the [start, end) row ranges to store, each quantized
    on its own (weight sync: the parts it received, `part_rows`, whose blocks start at their first row as a
    checkpoint's do); None: all rows as one range."""
    bn, bk = layer.weight_block_size
    for r0, r1 in rows or [(0, w.shape[0])]:
        part = w[r0:r1]
        if layer.weight_per_channel:
            q, per_row = quantize_weight_fp8_per_channel(part)
            expanded = per_row[:, None].expand(r1 - r0, -(-w.shape[1] // bk))
        else:
            q, scale = quantize_weight_fp8(part, (bn, bk))
            expanded = scale.repeat_interleave(bn, dim=0)[: r1 - r0]
        with torch.no_grad():
            if layer.weight.dtype == FP8_DTYPE:
                layer.weight[r0:r1].copy_(q)
                layer.weight_scale_inv[r0:r1].copy_(expanded)
            else:
                layer.weight[r0:r1].copy_(q.float() * expanded.repeat_interleave(bk, dim=1)[:, : w.shape[1]])


def dequantize_fp8_layer(layer: LinearBase, dtype: torch.dtype) -> None:
    """Replace the FP8 weight by weight * scale in `dtype` and drop the scale (forward becomes F.linear)."""
    if layer.weight.dtype != FP8_DTYPE:
        return
    k = layer.weight.shape[1]
    scale = layer.weight_scale_inv.repeat_interleave(layer.weight_block_size[1], dim=1)[:, :k]
    weight = nn.Parameter((layer.weight.float() * scale).to(dtype), requires_grad=False)
    weight.weight_loader = layer.weight_loader
    layer.weight = weight
    del layer.weight_scale_inv


def prepare_fp8_layers_for_gpu(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """After loading on an FP8 GPU: store every FP8 layer's scales outer-dim major (strides (1, N), in
    place: weight loaders and weight sync keep writing into them) and measure which GEMM backend is
    fastest per shape and token bucket, proven at the decode-graph batch sizes (`fxrewrite.kernels.fp8_tune.tune`).
    Returns the layer count."""
    shapes, count = set(), 0
    for module in model.modules():
        if isinstance(module, Fp8LinearMixin) and module.weight.dtype == FP8_DTYPE:
            scale = module.weight_scale_inv
            scale.data = scale.data.t().contiguous().t()
            shapes.add((*module.weight.shape, module.weight_per_channel))
            count += 1
    if shapes:
        fp8_tune.tune(shapes, device, dtype)
    return count


def fp8_gemm_supported(device: torch.device) -> bool:
    """FP8 tensor cores: CUDA compute capability 8.9 (Ada) or newer (Hopper: 9.0)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
