"""Linear layers with vLLM's names and tensor-parallel shape: Column, MergedColumn, QKV, Row.

Every parameter carries ``param.weight_loader(param, loaded_weight, loaded_shard_id=None)``, which
copies a full (unsharded) checkpoint tensor, or one shard of a fused tensor ("q"/"k"/"v" for
`QKVParallelLinear`, 0/1/... for `MergedColumnParallelLinear`), into this rank's slice.
Weights are ``[output_size_per_partition, input_size_per_partition]`` as in `nn.Linear`, so
`F.linear` is the whole forward and autograd, `torch.compile`, `.to()` and optimizers just work.
Layout and loader semantics follow vLLM `vllm/model_executor/layers/linear.py`.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch import nn

from fxrewrite.distributed import all_reduce_tp_shards
from fxrewrite.kernels import gemv_dispatch
from fxrewrite.kernels.gemv_dispatch import config_for_call
from fxrewrite.layers.activation import SiluAndMul


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what}={numerator} is not divisible by tp_size={denominator}")
    return numerator // denominator


def _check_tp(tp_size: int, tp_rank: int) -> None:
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"expected 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}")


def _narrow_full(loaded: torch.Tensor, dim: int, full: int, start: int, size: int) -> torch.Tensor:
    """`loaded.narrow(dim, start, size)` after checking the checkpoint tensor's full size along `dim` (a
    k_proj one row too long would otherwise load its first rows silently); ValueError naming both."""
    if loaded.dim() <= dim or loaded.shape[dim] != full:
        expected = (*loaded.shape[:dim], full, *loaded.shape[dim + 1 :])
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match {expected}")
    return loaded.narrow(dim, start, size)


_FP8_TAGS = ("F8_E4M3", "F8_E5M2")


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match {tuple(param.shape)}")
    tag = loaded.dtype_name() if hasattr(loaded, "dtype_name") else str(loaded.dtype)  # a lazy slice: no read
    if (tag in _FP8_TAGS or "float8" in tag) and param.dtype.itemsize > 1:
        raise ValueError(f"an FP8 tensor ({tag}) for a {param.dtype} parameter: its scales would be dropped (a layer "
                         "the quantization_config keeps in high precision must be stored in high precision)")
    if param.device.type != "meta":
        with torch.no_grad():
            param.copy_(loaded)


class LinearBase(nn.Module):
    """Shared parts: parameter creation on a chosen device/dtype and `weight_loader` wiring.

    Subclasses set ``output_size_per_partition``/``input_size_per_partition`` and override
    `weight_loader`.
    """

    row_partner: str | None = None
    """On a fused column-parallel layer: the host module's attribute name of the linear that reads its
    output (set by the pattern from the traced dataflow); `fxrewrite.sharding` makes that one row-parallel."""
    row_partner_why: str | None = None
    """Why there is none (`fxrewrite.patterns.feature_path`): what sharding's refusal says."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_size: int, tp_rank: int,
                 params_dtype: torch.dtype | None, device, in_per_part: int, out_per_part: int) -> None:
        super().__init__()
        _check_tp(tp_size, tp_rank)
        self.input_size, self.output_size = input_size, output_size
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.input_size_per_partition = in_per_part
        self.output_size_per_partition = out_per_part
        factory = {"dtype": params_dtype or torch.get_default_dtype(), "device": device}
        self.weight = nn.Parameter(torch.empty(out_per_part, in_per_part, **factory))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_per_part, **factory))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """`nn.Linear`'s initialisation (kaiming-uniform weight, uniform bias), skipped on meta and inside
        `no_weight_init`."""
        if self.weight.device.type == "meta" or getattr(_INIT, "skip", False):
            return
        tmp = nn.Linear(self.input_size_per_partition, self.output_size_per_partition,
                        bias=self.bias is not None, device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(tmp.weight)
            if self.bias is not None:
                self.bias.copy_(tmp.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., input_size_per_partition] -> [..., output_size_per_partition]; at decode token counts the
        skinny GEMV where `fxrewrite.kernels.gemv_dispatch` chose it, else cuBLAS."""
        return dispatch_linear(x, self.weight, self.bias)

    gemv_prologue: str | None = None
    """"norm" / "silu" on a layer its model calls through `norm_forward` / `silu_forward` (native models):
    the kind the load-time GEMV timing measures for it (`fxrewrite.layers.skinny.prepare_skinny_gemv`)."""

    def norm_forward(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None = None):
        """``(self(norm(x, residual)), x + residual)`` (residual None: ``(self(norm(x)), x)``) for a
        column-parallel layer after an `RMSNorm`; x, residual [..., input_size]. At decode token counts the
        norm and the residual add run inside the skinny GEMV where it was chosen (kind "norm")."""
        scales = self._gemv_operands()
        fusable = getattr(norm, "offset", None) == 0.0 and getattr(norm, "upcast", False) and scales is not None
        config = config_for_call("norm", x, self.weight, self.bias, norm.weight, residual,
                                 **(scales or {})) if fusable else None
        if config is None or (residual is not None and residual.shape != x.shape):
            h, residual = (norm(x), x) if residual is None else norm(x, residual)
            return self(h), residual
        lead, k = x.shape[:-1], x.shape[-1]
        res2 = residual.reshape(-1, k) if residual is not None else None
        out = gemv_dispatch.run(x.reshape(-1, k), self.weight, self.bias, config, norm_weight=norm.weight,
                                eps=norm.variance_epsilon, residual=res2, **scales)
        out, residual = (out[0], out[1].view(x.shape)) if res2 is not None else (out, x)
        return out.view(*lead, -1), residual

    def add_forward(self, x: torch.Tensor, out_residual: torch.Tensor) -> torch.Tensor:
        """``out_residual + self(x)``: x [..., input_size_per_partition], out_residual [..., output_size] (a decoder
        layer's closing residual add). At decode token counts, on a weight the skinny GEMV reads (float, or an FP8
        layer's) whose output is complete on this rank, the add runs in the GEMV's epilogue where it was chosen (kind
        "linear"; rounded as the two torch ops are); else torch's add."""
        config, scales = None, self._gemv_operands()
        if self._epilogue_fits(x, out_residual):
            config = config_for_call("linear", x, self.weight, self.bias, out_residual, **scales)
        if config is None:
            return out_residual + self(x)
        k, n = x.shape[-1], self.weight.shape[0]
        out = gemv_dispatch.run(x.reshape(-1, k), self.weight, self.bias, config, out_residual=out_residual.view(-1, n),
                                **scales)
        return out.view(*x.shape[:-1], n)

    def _epilogue_fits(self, x: torch.Tensor, out_residual: torch.Tensor) -> bool:
        """Whether `out_residual` can be added in the GEMV's epilogue: a product the skinny GEMV computes (a float
        weight's plain product, or an FP8 layer's), the whole output on this rank (not a row-parallel partial sum),
        out_residual of the output's shape and x's dtype, contiguous."""
        return (self._gemv_operands() is not None and not (isinstance(self, RowParallelLinear) and self.tp_size > 1)
                and out_residual.shape == (*x.shape[:-1], self.weight.shape[0]) and out_residual.dtype == x.dtype
                and out_residual.is_contiguous())

    def silu_forward(self, x: torch.Tensor, act: nn.Module, out_residual: torch.Tensor | None = None) -> torch.Tensor:
        """``self(act(x))`` for x [..., 2 * input_size_per_partition] holding [gate | up]; where the skinny GEMV
        was chosen (kind "silu") and `act` is `SiluAndMul`, silu(gate) * up is computed inside it. With
        out_residual [..., output_size]: ``out_residual + self(act(x))`` (`add_forward`; in the same GEMV's epilogue
        where it runs)."""
        scales = self._gemv_operands()
        fusable = type(act) is SiluAndMul and scales is not None
        config = config_for_call("silu", x, self.weight, self.bias, **(scales or {})) if fusable else None
        if config is None or x.shape[-1] != 2 * self.weight.shape[1]:
            h = act(x)
            return self(h) if out_residual is None else self.add_forward(h, out_residual)
        partial = isinstance(self, RowParallelLinear) and self.tp_size > 1
        epilogue = out_residual is not None and self._epilogue_fits(x[..., : self.weight.shape[1]], out_residual)
        out = gemv_dispatch.run(x.reshape(-1, x.shape[-1]), self.weight, None if partial else self.bias, config,
                                silu_mul=True, out_residual=out_residual.view(-1, self.weight.shape[0]) if epilogue
                                else None, **scales).view(*x.shape[:-1], -1)
        if partial:
            out = self._reduce(out)
        return out if out_residual is None or epilogue else out_residual + out

    def _plain_forward(self) -> bool:
        """True when this layer's forward is the plain product (not an FP8 or other override)."""
        return type(self).forward in (LinearBase.forward, RowParallelLinear.forward, QKVParallelLinear.forward)

    def _gemv_operands(self) -> dict | None:
        """The skinny GEMV's weight-scale arguments (`gemv_dispatch.run`: {} for a float weight, w_scale and
        per_channel for FP8 layers, which override this), or None when the product is not the GEMV's."""
        return {} if self._plain_forward() else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id=None) -> None:
        """Copy a full tensor (the unsharded default); subclasses shard it."""
        if loaded_shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shards, got loaded_shard_id={loaded_shard_id!r}")
        _copy_checked(param, loaded_weight)

    def extra_repr(self) -> str:
        """Per-rank sizes, bias and tp_size in the module's repr."""
        return (f"in_features={self.input_size_per_partition}, out_features={self.output_size_per_partition}, "
                f"bias={self.bias is not None}, tp_size={self.tp_size}")


class ReplicatedLinear(LinearBase):
    """The same full weight on every rank (MoE routers, FP8 layers of modules no pattern fused).

    Shapes: weight [output_size, input_size], bias [output_size]; forward x [..., input_size] ->
    [..., output_size]."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_size: int = 1, tp_rank: int = 0,
                 params_dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__(input_size, output_size, bias, tp_size, tp_rank, params_dtype, device,
                         input_size, output_size)


class ColumnParallelLinear(LinearBase):
    """Output dim split across ranks: weight [output_size / tp_size, input_size]; no gather here."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_size: int = 1, tp_rank: int = 0,
                 params_dtype: torch.dtype | None = None, device=None) -> None:
        out = _divide(output_size, tp_size, "output_size")
        super().__init__(input_size, output_size, bias, tp_size, tp_rank, params_dtype, device, input_size, out)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id=None) -> None:
        """Take this rank's rows of a full [output_size, ...] tensor."""
        if loaded_shard_id is not None:
            raise ValueError(f"ColumnParallelLinear has no shards, got loaded_shard_id={loaded_shard_id!r}")
        size = param.shape[0]
        _copy_checked(param, _narrow_full(loaded_weight, 0, self.output_size, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up of a gated MLP).

    ``output_sizes`` are the global sizes; each rank holds ``output_sizes[i] / tp_size`` rows of
    each part, parts in order. ``output_sizes_per_partition`` is what `forward`'s caller splits by.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, tp_size: int = 1,
                 tp_rank: int = 0, params_dtype: torch.dtype | None = None, device=None) -> None:
        self.output_sizes = [int(s) for s in output_sizes]
        self.output_sizes_per_partition = [_divide(s, tp_size, "output_sizes[i]") for s in self.output_sizes]
        super().__init__(input_size, sum(self.output_sizes), bias, tp_size, tp_rank, params_dtype, device)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id=None) -> None:
        """Shard id i: copy this rank's slice of part i; None: a full merged tensor."""
        if loaded_shard_id is None:
            for i, size in enumerate(self.output_sizes):
                start = sum(self.output_sizes[:i])
                self.weight_loader(param, _narrow_full(loaded_weight, 0, self.output_size, start, size), i)
            return
        if not isinstance(loaded_shard_id, int) or not 0 <= loaded_shard_id < len(self.output_sizes):
            raise ValueError(f"loaded_shard_id must be in 0..{len(self.output_sizes) - 1}, got {loaded_shard_id!r}")
        size = self.output_sizes_per_partition[loaded_shard_id]
        offset = sum(self.output_sizes_per_partition[:loaded_shard_id])
        full = self.output_sizes[loaded_shard_id]
        shard = _narrow_full(loaded_weight, 0, full, self.tp_rank * size, size)
        _copy_checked(param.data.narrow(0, offset, size), shard)


PENDING_NORM_ATTR = "_fxrewrite_pending_norm"
"""Instance attribute of a `QKVParallelLinear` while `fxrewrite.layers.input_norm.normed_call` runs: the RMSNorm its
next forward applies to its input first (`norm_forward`)."""


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; output per rank is [q | k | v].

    Heads are split across ranks; with fewer kv heads than ranks, kv heads are replicated
    (vLLM's rule). ``q_size``/``kv_size`` are per-rank widths (heads * head_size).
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False, tp_size: int = 1, tp_rank: int = 0,
                 params_dtype: torch.dtype | None = None, device=None) -> None:
        total_num_kv_heads = total_num_heads if total_num_kv_heads is None else total_num_kv_heads
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp_size, "total_num_heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads, self.num_kv_head_replicas = 1, _divide(tp_size, total_num_kv_heads, "kv replicas")
        else:
            self.num_kv_heads, self.num_kv_head_replicas = _divide(total_num_kv_heads, tp_size, "kv heads"), 1
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        self.output_sizes = [self.q_size, self.kv_size, self.kv_size]
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(hidden_size, output_size, bias, tp_size, tp_rank, params_dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`LinearBase.forward`; while a folded input norm is pending (`PENDING_NORM_ATTR`), of that norm of x, in the
        skinny GEMV's prologue where it was chosen (`norm_forward`)."""
        norm = self.__dict__.pop(PENDING_NORM_ATTR, None) if PENDING_NORM_ATTR in self.__dict__ else None
        return super().forward(x) if norm is None else self.norm_forward(x, norm)[0]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id=None) -> None:
        """Shard "q"/"k"/"v": copy this rank's heads of that projection; None: a full [q|k|v] tensor."""
        total_q = self.total_num_heads * self.head_size
        total_kv = self.total_num_kv_heads * self.head_size
        if loaded_shard_id is None:
            for sid, start, size in (("q", 0, total_q), ("k", total_q, total_kv), ("v", total_q + total_kv, total_kv)):
                self.weight_loader(param, _narrow_full(loaded_weight, 0, total_q + 2 * total_kv, start, size), sid)
            return
        if loaded_shard_id == "q":
            offset, size, rank, full = 0, self.q_size, self.tp_rank, total_q
        elif loaded_shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if loaded_shard_id == "v" else 0)
            size, rank, full = self.kv_size, self.tp_rank // self.num_kv_head_replicas, total_kv
        else:
            raise ValueError(f"loaded_shard_id must be 'q', 'k' or 'v', got {loaded_shard_id!r}")
        _copy_checked(param.data.narrow(0, offset, size), _narrow_full(loaded_weight, 0, full, rank * size, size))


class RowParallelLinear(LinearBase):
    """Input dim split across ranks: weight [output_size, input_size / tp_size].

    With tp_size > 1 each rank's output is a partial sum; ``reduce_results`` all-reduces it over
    the TP group of `fxrewrite.distributed` (the default group outside one; bias added once, after
    the reduction).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_size: int = 1, tp_rank: int = 0,
                 params_dtype: torch.dtype | None = None, device=None, reduce_results: bool = True) -> None:
        in_part = _divide(input_size, tp_size, "input_size")
        self.reduce_results = reduce_results
        super().__init__(input_size, output_size, bias, tp_size, tp_rank, params_dtype, device, in_part, output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., input_size / tp_size] -> [..., output_size] (summed over ranks when reducing)."""
        if self.tp_size == 1:
            return dispatch_linear(x, self.weight, self.bias)
        return self._reduce(dispatch_linear(x, self.weight))

    def _reduce(self, out: torch.Tensor) -> torch.Tensor:
        if self.reduce_results:
            all_reduce_tp_shards(out)
        return out if self.bias is None else out + self.bias

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id=None) -> None:
        """Weight: this rank's columns of a full [output_size, input_size]; bias: copied whole."""
        if loaded_shard_id is not None:
            raise ValueError(f"RowParallelLinear has no shards, got loaded_shard_id={loaded_shard_id!r}")
        if param.dim() == 2:
            size = param.shape[1]
            # (an FP8 layer's block scales [N, ceil(K / bk)] take their columns the same way, unchecked)
            full = self.input_size if param is self.weight else loaded_weight.shape[1]
            loaded_weight = _narrow_full(loaded_weight, 1, full, self.tp_rank * size, size)
        _copy_checked(param, loaded_weight)


_INIT = threading.local()


@contextlib.contextmanager
def no_weight_init():
    """Within (this thread): new linear layers keep uninitialised weights, for a builder that then loads
    every element (the rewrite's fused layers: a random init of Qwen3-4B's fused weights costs seconds)."""
    before = getattr(_INIT, "skip", False)
    _INIT.skip = True
    try:
        yield
    finally:
        _INIT.skip = before


def dispatch_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or the skinny GEMV where `fxrewrite.kernels.gemv_dispatch` chose it for this call."""
    config = config_for_call("linear", x, w, bias)
    if config is None:
        return F.linear(x, w, bias)
    k = x.shape[-1]
    return gemv_dispatch.run(x.reshape(-1, k), w, bias, config).view(*x.shape[:-1], w.shape[0])
