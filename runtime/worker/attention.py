"""Paged attention for both model kinds.

transformers models: `paged_attention_forward` is registered in transformers' `AttentionInterface` as
"fxrewrite_paged" and the model's attn implementation is set to that name. transformers builds no dense
mask for it: `masking_utils._preprocess_mask_arguments` exits early (mask None) for any implementation
that is not in `AttentionMaskInterface`, so on purpose no mask function is registered under this name.
Native models call the `Attention` layer. Both write this step's K/V into the layer's paged cache and
attend over it with the step metadata from `fxrewrite.runtime.worker.forward_context`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fxrewrite.distributed import get_tp_rank
from fxrewrite.errors import UnsupportedModelError
from fxrewrite.kernels.paged_attention import paged_attention
from fxrewrite.kernels.reshape_and_cache import reshape_and_cache
from fxrewrite.layers.kv_context import take_kv_written
from fxrewrite.runtime.worker.forward_context import get_forward_context

ATTN_IMPLEMENTATION = "fxrewrite_paged"


def paged_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scale: float,
                 sliding_window: int | None = None, soft_cap: float | None = None,
                 kv_cached: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, Hq, D], key/value [T, Hkv, D] of this step -> [T, Hq, D]; caches the new K/V first, unless
    `kv_cached` says the caller already wrote them (`layer_kv_cache`, e.g. a fused rotary + cache kernel).
    `sinks`: None or [Hq] attention-sink logits (GPT-OSS; see `fxrewrite.kernels.paged_attention`).

    Under torch.compile this is one opaque op (`fxrewrite.runtime.worker.compilation`, whose op runs
    `attend_now`), so the graph does not break on the forward context. Inside a regionally compiled decoder
    layer the op gets layer index -1 and reads the running layer's index (`running_layer`) when it runs: the
    index never enters the graph, so one graph (and no guard on the index) serves every layer."""
    if not torch.compiler.is_compiling():
        return attend_now(query, key, value, layer_idx, scale, sliding_window, soft_cap, kv_cached, sinks)
    index = -1 if RUNNING_LAYER.regional else layer_idx
    return torch.ops.fxrewrite.paged_attend(query, key, value, index, scale, sliding_window, soft_cap, kv_cached, sinks)


class _RunningLayer:
    """Which regionally compiled decoder layer is running (its index; -1 outside one), set by
    `fxrewrite.runtime.worker.compilation` around each compiled layer call."""
    regional = False  # set once some model is compiled layer by layer (read while dynamo traces)
    index = -1


RUNNING_LAYER = _RunningLayer()


def running_layer(layer_idx: int) -> int:
    """`layer_idx`, or the running compiled layer's index when `layer_idx` is -1 (RuntimeError outside one)."""
    if layer_idx >= 0:
        return layer_idx
    if RUNNING_LAYER.index < 0:
        raise RuntimeError("paged attention got layer index -1 outside a compiled decoder layer")
    return RUNNING_LAYER.index


def layer_kv_cache(layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache, slot_mapping) of layer `layer_idx` in this step (caches [num_blocks,
    block_size, Hkv, D], slot_mapping int64 [>= T]), for a kernel that writes the step's K/V itself.
    RuntimeError outside a model runner step."""
    ctx = get_forward_context()
    key_cache, value_cache = ctx.kv_caches[layer_idx]
    return key_cache, value_cache, ctx.slot_mapping


def attend_now(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scale: float,
               sliding_window: int | None = None, soft_cap: float | None = None,
               kv_cached: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_attend` run eagerly: write K/V into layer `layer_idx`'s paged cache (the forward context's,
    not an argument, so not a declared mutation of the custom op) unless `kv_cached`, then attend over it."""
    ctx = get_forward_context()
    key_cache, value_cache = ctx.kv_caches[running_layer(layer_idx)]
    if not kv_cached:
        reshape_and_cache(key, value, key_cache, value_cache, ctx.slot_mapping)
    return paged_attention(
        query, key_cache, value_cache, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc,
        ctx.max_query_len, ctx.max_seq_len, scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
        static_metadata=True,  # the step's metadata, copied in before the forward
    )


_recorded_layers: dict[int, tuple[int, int]] | None = None


@contextmanager
def recording_attention_layers() -> Iterator[dict[int, tuple[int, int]]]:
    """{layer index: (key/value heads, head width as cached)} of the transformers attention calls that reached
    `paged_attention_forward` inside the block (eager runs only: a compiled graph does not replay the record), which
    holds one forward: a second call for one layer, or a mask of the model's own, is refused there (`_record_call`)."""
    global _recorded_layers
    _recorded_layers = {}
    try:
        yield _recorded_layers
    finally:
        _recorded_layers = None


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, Hq, T, D], key/value [1, Hkv, T, D]
    (the step's flattened tokens as one batch row) -> ([1, T, Hq, D], None). A narrower value
    ([1, Hkv, T, Dv], multi-head latent attention) gives [1, T, Hq, Dv], a wider one too. Attention sinks (`s_aux` / `sinks`,
    [Hq]) are applied; NotImplementedError for the arguments in UNSUPPORTED_ARGUMENTS and is_causal=False.

    The layer index comes from `module.layer_idx`; scaling defaults to D**-0.5 like transformers'. The K/V
    cache write is skipped when a fused layer already wrote exactly `key` and `value` there this step
    (`fxrewrite.layers.kv_context`).
    """
    if query.shape[0] != 1:
        raise ValueError(f"fxrewrite_paged attention expects one flattened batch row, got {query.shape[0]}")
    _refuse_unsupported(module, kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    # in a regionally compiled layer the op reads the running layer's index (`paged_attend`): module.layer_idx, an int
    # attribute, must not even be read while dynamo traces (torch 2.11 guards on it: a recompile per layer, and
    # past dynamo's recompile limit (8) the later layers ran eagerly)
    layer_idx = -1 if torch.compiler.is_compiling() and RUNNING_LAYER.regional else module.layer_idx
    kv_cached = take_kv_written(layer_idx, key, value)  # a fused q/k-norm + rotary op wrote them
    value_dim = value.shape[-1]
    # multi-head latent attention: keys and values of different widths share the cache's width; zero channels leave
    # the scores (queries and keys padded alike) and the output's first value_dim channels exact
    if value_dim < key.shape[-1]:
        value = torch.nn.functional.pad(value, (0, key.shape[-1] - value_dim))
    elif value_dim > key.shape[-1]:
        pad = (0, value_dim - key.shape[-1])
        query, key = torch.nn.functional.pad(query, pad), torch.nn.functional.pad(key, pad)
    if _recorded_layers is not None:
        _record_call(module, key, attention_mask)
    out = paged_attend(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
        layer_idx, scale, sliding_window=window, soft_cap=softcap, kv_cached=kv_cached,
        sinks=_sinks(kwargs, query.shape[1]),
    )
    return out[..., :value_dim].unsqueeze(0), None


# Arguments transformers' attention calls pass that change what attention computes; the paged kernels do not
# implement them, so a model passing one stops with this error instead of generating from a different model.
UNSUPPORTED_ARGUMENTS = {"position_bias": "an additive position bias", "block_indices": "block-sparse attention"}


def _record_call(module: nn.Module, key: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """Note the layer's cached key layout (`recording_attention_layers`). UnsupportedModelError when the layer already
    attended in this forward (DiffLlama's two value halves, Dory's recurrent loops: the paged cache holds one key/value
    pair per layer and token, so the second call's write replaces the first's) or when the call carries a mask that
    is not the step's causal mask (Doge's dynamic mask: the paged kernels build the causal / sliding mask
    themselves and read no mask)."""
    name, layer = type(module).__name__, module.layer_idx
    if layer in _recorded_layers:
        raise UnsupportedModelError(
            f"{name} calls attention more than once for layer {layer} in one forward, which fxrewrite's paged KV cache "
            "(one key/value pair per layer and token) cannot hold; this model cannot be served here")
    if attention_mask is not None and not _is_causal_mask(attention_mask):
        raise UnsupportedModelError(
            f"{name} passes attention a mask of its own ({attention_mask.dtype} {list(attention_mask.shape)}, not the "
            "causal mask), which fxrewrite's paged attention does not read; this model cannot be served here")
    _recorded_layers[layer] = (key.shape[1], key.shape[-1])


def _is_causal_mask(mask: torch.Tensor) -> bool:
    """Whether `mask` [.., T, S] (bool: True attends; float: 0 attends, very negative masks) is the plain causal
    mask of one sequence's T newest tokens among S, as in the load check's one-sequence step."""
    if mask.dim() < 2 or mask.shape[-1] < mask.shape[-2]:
        return False
    rows, cols = mask.shape[-2:]
    causal = torch.ones(rows, cols, dtype=torch.bool, device=mask.device).tril(cols - rows)
    attends = mask if mask.dtype == torch.bool else mask == 0
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
        return False  # additive values other than "attend" and "masked": a bias
    return bool((attends == causal).all())


def _sinks(kwargs: dict, num_heads: int) -> torch.Tensor | None:
    """The attention-sink logits a transformers attention call passes (GPT-OSS's `s_aux`; `sinks` elsewhere), for this
    rank's `num_heads` query heads: under tensor parallelism the module keeps all heads' sinks and rank r holds heads
    [r * num_heads, (r + 1) * num_heads) (QKVParallelLinear's order)."""
    sinks = kwargs["s_aux"] if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    if sinks is None or sinks.shape[0] == num_heads:
        return sinks
    return sinks.narrow(0, get_tp_rank() * num_heads, num_heads)


def _refuse_unsupported(module: nn.Module, kwargs: dict) -> None:
    """NotImplementedError naming the model's attention class and the argument when the call asks for something
    the paged attention does not compute (UNSUPPORTED_ARGUMENTS, or `is_causal=False`)."""
    asked = [f"{name} ({what})" for name, what in UNSUPPORTED_ARGUMENTS.items() if kwargs.get(name) is not None]
    # transformers' attention functions read the module's `is_causal` when the call passes none (BERT / RoBERTa set
    # it from `config.is_decoder`)
    is_causal = kwargs.get("is_causal")
    if (getattr(module, "is_causal", True) if is_causal is None else is_causal) is False:
        asked.append("is_causal=False (bidirectional attention)")
    if asked:
        raise UnsupportedModelError(
            f"{type(module).__name__} calls attention with {', '.join(asked)}, which fxrewrite's paged attention "
            "does not compute; this model cannot be served here")


def register_paged_attention() -> str:
    """Register "fxrewrite_paged" in transformers' attention registry (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


class Attention(nn.Module):
    """Paged attention layer of the native models: q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D]."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        layer_idx: int,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cached: bool = False) -> torch.Tensor:
        """kv_cached: k and v are already in this layer's cache (see `paged_attend`)."""
        out = paged_attend(
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
            self.layer_idx, self.scale, self.sliding_window, self.soft_cap, kv_cached,
        )
        return out.reshape(-1, self.num_heads * self.head_dim)
