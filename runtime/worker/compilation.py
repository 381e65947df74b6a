"""torch.compile of the decoder layers (regional: one graph for every layer), paged attention one opaque op.

The attention of a step reads its metadata (slot mapping, block tables, lengths, KV caches) from
`fxrewrite.runtime.worker.forward_context`, a Python global that changes every step. Traced by dynamo it
would become guards and graph inputs (and a recompile for every new `max_seq_len`), so attention is
registered as the custom op `fxrewrite::paged_attend` (vLLM's `unified_attention` idea): dynamo sees
q, k, v in and one tensor out, inductor fuses everything around it, and the op reads the context
when it runs (the layer's KV cache included: `running_layer`). `fxrewrite.runtime.worker.attention.paged_attend`
routes to the op only while compiling. Issue 14 item 1: before, the whole forward was one graph, 28 layers
unrolled, and took minutes to compile.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch._dynamo.exc
import torch._inductor.config
import torch._inductor.exc
import torch.fx.experimental._config
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from torch import nn

from fxrewrite import data_parallel, distributed
from fxrewrite.kernels import env_choice
from fxrewrite.runtime.engine_config import check_compilation_config
from fxrewrite.runtime.model_files.model_cache import cache_root
from fxrewrite.runtime.worker.attention import RUNNING_LAYER, attend_now
from fxrewrite.runtime.worker.pipeline import PPMissingLayer, pipeline_stage_of_this_rank

logger = logging.getLogger(__name__)

OP_NAME = "fxrewrite::paged_attend"


# The op's schema comes from `attend_now`'s annotations; it reads the forward context when it runs.
paged_attend_op = torch.library.custom_op(OP_NAME, attend_now, mutates_args=())


@paged_attend_op.register_fake
def _paged_attend_fake(query, key, value, layer_idx, scale, sliding_window=None, soft_cap=None, kv_cached=False,
                       sinks=None):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def should_compile(config, device: torch.device) -> bool:
    """Compile on CUDA when `compilation_config` is 1-3 (opt-in, default 0) and not enforce_eager (which
    turns off torch.compile and CUDA graphs both). UserInputError (a ValueError) when compilation_config is
    not an int in 0..3 (vLLM's levels). A level > 0 off CUDA runs eager, and says so once in the log."""
    level = check_compilation_config(getattr(config, "compilation_config", 0))
    if level > 0 and device.type != "cuda":
        logger.warning("compilation_config=%d: torch.compile runs on CUDA only; the %s model runs eager", level,
                       device.type)
    # batch_invariant: Inductor would fuse the norms and rotary with other roundings than the trainer's eager ops
    return device.type == "cuda" and not config.enforce_eager and level > 0 and not getattr(config, "batch_invariant", False)


def compile_model(model: nn.Module, backend: str | Callable = "inductor") -> nn.Module:
    """Compile `model` in place, region by region; returns model. Idempotent.

    Regional compilation (PyTorch's recipe for repeated blocks): each decoder layer's `forward` is wrapped
    in `torch.compile`, not the whole model. Every layer runs the same code object and, with
    `inline_inbuilt_nn_modules` (torch's default), its parameters are graph inputs, so one compiled graph
    serves all layers (native models: the first layer, whose residual is None, has its own).
    Compile time therefore does not grow with the layer count, and an unrolled 28-layer graph is never
    built. The layer index, an int attribute, would be a guard (one graph per layer); it stays out of the
    graph: the attention op reads the running layer's index, set around each layer call.

    dynamic=True: the token count T is symbolic from the first call (no "automatic dynamic" recompile);
    the hidden size is fixed by the weights it meets. Dynamo specialises T = 1 (a second graph per layer
    kind: 2 graphs for transformers models, 4 for native ones, whatever the layer count). Default Inductor
    mode: no max-autotune, no coordinate-descent tuning (minutes of benchmarking at startup).
    The embedding, the final norm and `compute_logits` stay eager. A model without a decoder-layer list
    (`decoder_layers` is None) has its whole forward compiled instead.
    """
    if getattr(model, "_fxrewrite_compiled", False):
        return model
    use_compile_cache()
    layers = decoder_layers(model)
    eager_forward = model.forward
    if layers is None:
        compiled = torch.compile(eager_forward, dynamic=True, fullgraph=False, backend=backend)
        model.forward = _compiled_or_eager(compiled, eager_forward)
        model._fxrewrite_eager_layers = []
    else:
        model._fxrewrite_eager_layers = [(layer, layer.__dict__.get("forward")) for layer in layers]
        RUNNING_LAYER.regional = True
        for index, layer in enumerate(layers):
            if not isinstance(layer, PPMissingLayer):  # another pipeline stage's layer: never called here
                compiled = torch.compile(layer.forward, dynamic=True, fullgraph=False, backend=backend)
                layer.forward = _as_running_layer(index, compiled, layer.forward)
        model.forward = _regional_forward(eager_forward)
    model._fxrewrite_compiled = True
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The repeated decoder layers: `model.model.layers` (native) or `hf_model.base_model.layers`
    (transformers, the list the rewrite and pipeline parallelism walk); None when there is no such list."""
    hf = getattr(model, "hf_model", None)
    inner = getattr(hf, "base_model", None) if hf is not None else getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) > 0 else None


def _regional_forward(forward: Callable) -> Callable:
    """The model's `forward(input_ids, positions)` around compiled layers: `positions` at storage offset 0 (the
    engine may pass a slice of a packed buffer; dynamo makes a nonzero offset a symbol with guards, so slices
    and whole tensors would each get their graphs: one small copy of T int64s on the eager steps instead), and
    dynamo's duck sizing off while it traces (else two sizes equal by chance at the first compile become one
    symbol and a guard, and a later step recompiles)."""
    @functools.wraps(forward)
    def run(input_ids: torch.Tensor, positions: torch.Tensor, *args, **kwargs):
        if positions.storage_offset():
            positions = positions.clone()
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return forward(input_ids, positions, *args, **kwargs)
    return run


def _as_running_layer(index: int, compiled: Callable, eager: Callable) -> Callable:
    """`compiled` (layer `index`'s compiled forward) run with `index` as the running layer, which the
    attention op reads (`fxrewrite.runtime.worker.attention.running_layer`) instead of a graph constant;
    `eager` (its forward before compiling) instead inside `eager_forwards`."""
    def run(*args, **kwargs):
        if _EAGER.active:
            return eager(*args, **kwargs)
        previous, RUNNING_LAYER.index = RUNNING_LAYER.index, index
        try:
            return compiled(*args, **kwargs)
        finally:
            RUNNING_LAYER.index = previous
    run._fxrewrite_compiled_layer = compiled
    return run


def _compiled_or_eager(compiled: Callable, eager: Callable) -> Callable:
    """A whole compiled forward (no decoder-layer list): `eager` instead inside `eager_forwards`."""
    @functools.wraps(eager)
    def run(*args, **kwargs):
        return (eager if _EAGER.active else compiled)(*args, **kwargs)
    return run


class _EagerSwitch(threading.local):
    """Per thread: two engines in one process may step from two threads, each with its own choice."""
    active = False


_EAGER = _EagerSwitch()


COMPILED_FORWARD_ENV = "FXREWRITE_COMPILED_FORWARD"


def compiled_model_forwards() -> tuple[str, ...]:
    """The forwards of a compiled model that the engine times against each other, keeping the faster: ("compiled",
    "eager") by default (`FXREWRITE_COMPILED_FORWARD=auto`), once for the steps that run outside CUDA graphs
    (`fxrewrite.runtime.worker.warmup.faster_step_forward`) and per decode bucket (its graph's replay,
    `fxrewrite.runtime.worker.cuda_graphs`). On one process only: under tensor, pipeline or DP x EP parallelism the
    ranks' timings would include waiting for each other, so ("compiled",). `FXREWRITE_COMPILED_FORWARD=compiled` /
    `eager` forces one. Why: where the rewrite put its hand-written kernels (the skinny GEMVs with the norm or SiLU
    fused in, chained under PDL; the q/k norm + rotary + cache write), they beat Inductor's code for Qwen3 shapes
    and the compiled layers add host work per call; where it did not (transformers code without the rewrite),
    Inductor's fusions win by far (BENCHMARKS.md, fiftieth session). ValueError for another value."""
    mode = compiled_forward_mode()
    if mode != "auto":
        return (mode,)
    alone = (distributed.get_tp_size() == 1 and pipeline_stage_of_this_rank() is None
             and not data_parallel.dp_ep_active())
    return ("compiled", "eager") if alone else ("compiled",)


def eager_forwards_active() -> bool:
    """Whether this thread is inside `eager_forwards`."""
    return _EAGER.active


def model_forwards(model: nn.Module) -> tuple[str, ...]:
    """The forwards a step of `model` may run (a decode bucket is captured from each, the faster kept; memory
    profiling runs each): ("model",) for a model that is not compiled, else `compiled_model_forwards()`."""
    return compiled_model_forwards() if getattr(model, "_fxrewrite_compiled", False) else ("model",)


def compiled_forward_mode() -> str:
    """`FXREWRITE_COMPILED_FORWARD`: "auto" (default), "compiled" or "eager"; ValueError naming another value."""
    return env_choice(COMPILED_FORWARD_ENV, "auto", ("auto", "compiled", "eager"))


def forwards_of(kind: str) -> contextlib.AbstractContextManager:
    """The context a forward of `kind` runs in: `eager_forwards()` for "eager", else nothing ("compiled", "model")."""
    return eager_forwards() if kind == "eager" else contextlib.nullcontext()


@contextlib.contextmanager
def eager_forwards() -> Iterator[None]:
    """Within (this thread): models compiled by `compile_model` run their eager forwards (the compiled ones stay
    built). The CUDA graph runner captures a decode bucket's eager graph under it (`cuda_graphs`), and the model
    runner runs its steps outside graphs under it when the eager forward was the faster (`forwards_of`)."""
    before, _EAGER.active = _EAGER.active, True
    try:
        yield
    finally:
        _EAGER.active = before


def restore_eager(model: nn.Module) -> None:
    """Undo `compile_model`: the model and its layers run their eager forwards again."""
    for layer, instance_forward in getattr(model, "_fxrewrite_eager_layers", ()):
        if instance_forward is None:
            layer.__dict__.pop("forward", None)
        else:
            layer.forward = instance_forward
    model.__dict__.pop("forward", None)
    model._fxrewrite_eager_layers = []
    model._fxrewrite_compiled = False


def use_compile_cache() -> Path:
    """Point Inductor's and Triton's on-disk caches at `$FXREWRITE_CACHE/torch_compile` (unless the user
    chose TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR), so a second start reuses compiled graphs (the FX
    graph and AOTAutograd caches) and kernels. Returns the folder. Both libraries read these variables
    when they look for a cache entry, so this must run before the first compile.

    Importing `torch._inductor` already writes its default (`/tmp/torchinductor_<user>`) into
    TORCHINDUCTOR_CACHE_DIR, so that value counts as unset: a plain `setdefault` would never take effect."""
    root = cache_root() / "torch_compile"
    inductor_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if inductor_dir is None or os.path.abspath(inductor_dir) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
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
        restore_eager(model)
        return model(input_ids, positions)
