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
import torch._dynamo.exc
import torch._inductor.config
import torch._inductor.exc
from torch import nn

from fxrewrite.runtime.model_files.model_cache import cache_root
from fxrewrite.runtime.worker.attention import attend_now

logger = logging.getLogger(__name__)

OP_NAME = "fxrewrite::paged_attend"


# The op's schema comes from `attend_now`'s annotations; it reads the forward context when it runs.
paged_attend_op = torch.library.custom_op(OP_NAME, attend_now, mutates_args=())


@paged_attend_op.register_fake
def _paged_attend_fake(query, key, value, layer_idx, scale, sliding_window=None, soft_cap=None, kv_cached=False):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def should_compile(config, device: torch.device) -> bool:
    """Compile on CUDA when `compilation_config` is 1-3 (opt-in, default 0) and not enforce_eager (which
    turns off torch.compile and CUDA graphs both). ValueError when compilation_config is not an int in
    0..3 (vLLM's levels)."""
    level = getattr(config, "compilation_config", 0)
    if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= 3:
        raise ValueError(f"compilation_config={level!r}: expected an optimisation level 0, 1, 2 or 3")
    # batch_invariant: Inductor would fuse the norms and rotary with other roundings than the trainer's eager ops
    return device.type == "cuda" and not config.enforce_eager and level > 0 and not getattr(config, "batch_invariant", False)


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


# Errors that mean "torch.compile could not compile this model" (dynamo could not trace it, the
# backend or inductor failed); anything else a compiled forward raises (an OOM, a bug in the model
# or in our kernels) is raised as is, never hidden by an eager rerun.
COMPILE_FAILURES: tuple[type[BaseException], ...] = (
    torch._dynamo.exc.BackendCompilerFailed,
    torch._dynamo.exc.Unsupported,
    torch._dynamo.exc.InternalTorchDynamoError,
    torch._dynamo.exc.TorchRuntimeError,
    torch._dynamo.exc.InvalidBackend,
    torch._inductor.exc.InductorError,
    torch._inductor.exc.LoweringException,
)


def is_compile_failure(error: BaseException) -> bool:
    """True when `error` is one of `COMPILE_FAILURES` and no out-of-memory error is among its causes
    (inductor wraps an OOM of its autotuning in BackendCompilerFailed: that is still an OOM)."""
    if not isinstance(error, COMPILE_FAILURES):
        return False
    seen, cause = set(), error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, torch.OutOfMemoryError):
            return False
        seen.add(id(cause))
        cause = getattr(cause, "inner_exception", None) or cause.__cause__ or cause.__context__
    return True


def forward_or_fallback(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`model(input_ids, positions)`. When the compiled forward fails to *compile* (`is_compile_failure`),
    log an error once, restore the eager forward and run that (a model torch.compile cannot handle
    still serves, and says so). Every other error, an OOM included, is raised unchanged."""
    try:
        return model(input_ids, positions)
    except Exception as e:
        if not getattr(model, "_fxrewrite_compiled", False) or not is_compile_failure(e):
            raise
        logger.error("torch.compile of %s failed (%s: %s); this engine runs the model eagerly from now on",
                     type(model).__name__, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        del model.forward
        model._fxrewrite_compiled = False
        return model(input_ids, positions)
