"""Load-time choice of the skinny GEMV per layer shape (`fxrewrite.kernels.gemv_tune`), for a model built
from the fused layers: native models and the rewritten (`after`) transformers models alike.

Every `LinearBase` (and `ParallelLMHead`) with a bf16 / fp16 / fp32 weight, or an FP8 weight with 128-column
scale groups (`fxrewrite.kernels.skinny_gemv_fp8`; its baseline is the FP8 GEMM `fxrewrite.kernels.fp8_tune`
chose at load), is measured with the kind its model calls it with: "norm" / "silu" where the layer's
``gemv_prologue`` says the model calls `norm_forward` / `silu_forward` (the native decoder layers), else
"linear".
"""

from __future__ import annotations

import torch
from torch import nn

from fxrewrite.kernels import gemv_dispatch, gemv_tune
from fxrewrite.kernels.skinny_gemv import GEMV_MAX_M
from fxrewrite.layers.linear import LinearBase, ReplicatedLinear
from fxrewrite.layers.vocab_embedding import ParallelLMHead

__all__ = ["adopt_plain_linears", "gemv_shapes", "prepare_skinny_gemv"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def gemv_shapes(model: nn.Module) -> set[tuple[str, int, int, str, int]]:
    """{(kind, N, K, weight format, scale rows)} of the model's layers the skinny GEMV may serve (per-rank weight
    shapes; formats as `gemv_dispatch.weight_format`; scale rows: a block-scaled FP8 layer's ``weight_scale_rows``,
    the fewest among layers of one shape, else 1), so the tuner times the FP8 product each layer runs."""
    rows: dict[tuple[str, int, int, str], int] = {}
    for module in model.modules():
        if not isinstance(module, (LinearBase, ParallelLMHead)) or module.weight.dim() != 2:
            continue
        scales = module._gemv_operands() if isinstance(module, LinearBase) else {}
        fmt = gemv_dispatch.weight_format(module.weight, **scales) if scales is not None else None
        if fmt is not None:
            key = (getattr(module, "gemv_prologue", None) or "linear", *module.weight.shape, fmt)
            shared = getattr(module, "weight_scale_rows", 1) if fmt == "fp8" else 1
            rows[key] = min(rows.get(key, shared), shared)
    return {(*key, r) for key, r in rows.items()}


def adopt_plain_linears(model: nn.Module) -> int:
    """Replace every plain `nn.Linear` with a float weight (a rewritten transformers model's o_proj,
    down_proj, lm_head... at TP 1) by a `ReplicatedLinear` holding the same parameters, so that it too
    dispatches between the skinny GEMV and cuBLAS. Names and values are unchanged. Returns the count."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype in _FLOATS:
                new = ReplicatedLinear(child.in_features, child.out_features, bias=child.bias is not None,
                                       params_dtype=child.weight.dtype, device="meta")
                new.weight, new.bias = child.weight, child.bias
                setattr(parent, name, new)
                count += 1
    return count


def prepare_skinny_gemv(model: nn.Module, device: torch.device, dtype: torch.dtype, max_num_seqs: int) -> dict:
    """On a CUDA device unless FXREWRITE_GEMV=off: `adopt_plain_linears`, then (FXREWRITE_GEMV=auto) time
    the skinny GEMV against cuBLAS for every shape of `gemv_shapes(model)` at the decode token buckets up
    to min(max_num_seqs, GEMV_MAX_M), recording the winners (`fxrewrite.kernels.gemv_tune`). Returns the
    timings ({} when nothing was measured)."""
    if torch.device(device).type != "cuda" or gemv_dispatch.mode() == "off":
        return {}
    adopt_plain_linears(model)
    if gemv_dispatch.mode() != "auto":
        return {}
    shapes = gemv_shapes(model)
    return gemv_tune.tune(shapes, device, dtype, min(max_num_seqs, GEMV_MAX_M)) if shapes else {}
