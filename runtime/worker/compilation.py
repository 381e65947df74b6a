"""torch.compile of the model forward, with paged attention as one opaque custom op.

The attention of a step reads its metadata (slot mapping, block tables, lengths, KV caches) from
`fxrewrite.runtime.worker.forward_context`, a Python global that changes every step. Traced by dynamo it
would become guards and graph inputs (and a recompile for every new `max_seq_len`), so attention is
registered as the custom op `fxrewrite::paged_attend` (vLLM's `unified_attention` idea): dynamo sees
q, k, v in and one tensor out, inductor fuses everything around it, and the op reads the context
when it runs. `fxrewrite.runtime.worker.attention.paged_attend` routes to the op only while compiling.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch._inductor.config
from torch import nn

from fxrewrite.runtime.model_files.model_cache import cache_root

logger = logging.getLogger(__name__)

OP_NAME = "fxrewrite::paged_attend"


@torch.library.custom_op(OP_NAME, mutates_args=())
def paged_attend_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq, D]; writes this step's K/V into the layer's
    paged cache (held by the forward context, not an argument, so not a declared mutation) first."""
    from fxrewrite.runtime.worker.attention import paged_attend

    return paged_attend(query, key, value, layer_idx, scale, sliding_window, soft_cap)


@paged_attend_op.register_fake
def _paged_attend_fake(query, key, value, layer_idx, scale, sliding_window=None, soft_cap=None):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def should_compile(config, device: torch.device) -> bool:
    """Compile on CUDA when `compilation_config` is 1-3 (opt-in, default 0) and not enforce_eager (which
    turns off torch.compile and CUDA graphs both). ValueError when compilation_config is not an int in
    0..3 (vLLM's levels)."""
    level = getattr(config, "compilation_config", 0)
    if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= 3:
        raise ValueError(f"compilation_config={level!r}: expected an optimisation level 0, 1, 2 or 3")
    return device.type == "cuda" and not config.enforce_eager and level > 0


def compile_model(model: nn.Module) -> nn.Module:
    """Compile `model.forward` (input_ids [T], positions [T] -> hidden [T, H]) in place; returns model.

    dynamic=True: one graph for every token count T (inductor specialises T = 1 separately).
    `compute_logits` stays eager: it runs on the few sampled rows only. Idempotent.
    """
    if getattr(model, "_fxrewrite_compiled", False):
        return model
    use_compile_cache()
    model.forward = torch.compile(model.forward, dynamic=True, fullgraph=False)
    model._fxrewrite_compiled = True
    return model


def use_compile_cache() -> Path:
    """Point Inductor's and Triton's on-disk caches at `$FXREWRITE_CACHE/torch_compile` (unless the user
    set TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR), so a second start reuses compiled graphs and kernels.
    Returns the folder. Both libraries read these variables when they first look for a cache entry."""
    root = cache_root() / "torch_compile"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    torch._inductor.config.fx_graph_cache = True
    return root


def forward_or_fallback(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`model(input_ids, positions)`; when a compiled forward fails to compile or run, log a warning,
    restore the eager forward and run that (a model torch.compile cannot handle still serves)."""
    try:
        return model(input_ids, positions)
    except Exception as e:
        if not getattr(model, "_fxrewrite_compiled", False):
            raise
        logger.warning("torch.compile of %s failed, running eagerly: %s", type(model).__name__, e)
        del model.forward
        model._fxrewrite_compiled = False
        return model(input_ids, positions)
