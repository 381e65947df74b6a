"""SDPA attention whose causal mask stays implicit under ``torch.compile`` (``is_causal=True``, no [B, 1, S, S] mask).

Eager transformers drops the causal mask of an unpadded batch (SDPA then takes ``is_causal=True``: the flash kernel,
grouped-query attention without copies). While dynamo traces it cannot: the base model always passes position ids
(``arange`` when the caller gave none) to ``create_causal_mask``, whose packed-sequence check
(``find_packed_sequence_indices``) cannot read them while tracing, so it assumes packing, forbids the skip and
builds a [B, 1, S, S] mask (transformers 5.17 to 5.24). The compiled step then runs SDPA with an explicit mask: on
CUDA not the flash kernel, k and v repeated to every query head by copies (``use_gqa_in_sdpa`` wants no mask), and
the mask and the copies saved for the backward.

``fxrewrite_sdpa`` is transformers' own ``sdpa_attention_forward`` with ``sdpa_mask`` as its mask function, except
that while compiling, a call that can only mean the plain causal mask returns None, as the eager path does:
a forward pre-hook on the base model (:func:`use_sdpa_causal`) notes that the call has no padding mask, no
position ids (so the positions are ``arange``: nothing is packed), no cache, no cache position and no other
argument that shapes masks; the mask call comes from ``create_causal_mask`` (no ``allow_is_bidirectional_skip``
argument, no ``local_size``: sliding-window, chunked and bidirectional masks keep theirs), without the model's
own ``or``/``and`` mask functions (``use_vmap`` False), with equal query and key lengths and no offsets.
Otherwise, and always outside compilation, ``sdpa_mask`` decides. ``FXREWRITE_COMPILE_CAUSAL_SKIP=0`` keeps
transformers' behaviour, to measure one against the other.
"""

from __future__ import annotations

import inspect
import linecache
import os
import re

import torch
from torch import nn
from transformers import masking_utils  # at import time: dynamo (torch 2.11) cannot trace transformers' lazy import

__all__ = ["SDPA_CAUSAL", "register_sdpa_causal", "use_sdpa_causal", "sdpa_causal_mask", "sdpa_read_by_name"]

SDPA_CAUSAL = "fxrewrite_sdpa"
# base-model arguments that may be set without changing the mask (everything else must be None or absent)
_NEUTRAL = frozenset({"input_ids", "inputs_embeds", "use_cache", "output_attentions", "output_hidden_states",
                      "return_dict", "num_items_in_batch", "labels", "logits_to_keep"})


# set by the base model's pre-hook for the running forward; a dict, not a class attribute: dynamo (torch 2.11)
# cannot trace setattr on a class
_CALL = {"unpadded_default_positions": False}


class _NoteCall:
    """Forward pre-hook (with kwargs) of the base model: whether this call's mask can only be the causal one.
    Unpickled (a pickled model, in another process) it registers ``fxrewrite_sdpa`` there, which the config names."""

    def __call__(self, module, args, kwargs) -> None:
        _CALL["unpadded_default_positions"] = not args and all(v is None or k in _NEUTRAL for k, v in kwargs.items())

    def __reduce__(self):
        return _registered_note_call, ()


def _registered_note_call() -> _NoteCall:
    register_sdpa_causal()
    return _NoteCall()


def _can_skip(kwargs: dict) -> bool:
    if not _CALL["unpadded_default_positions"] or "allow_is_bidirectional_skip" in kwargs:
        return False
    if kwargs.get("attention_mask") is not None or kwargs.get("local_size") is not None or kwargs.get("use_vmap"):
        return False
    if "mask_function" not in kwargs or "q_length" not in kwargs or "kv_length" not in kwargs:
        return False
    if not (kwargs["mask_function"] is masking_utils.causal_mask_function or not kwargs.get("allow_is_causal_skip")):
        return False  # a plain causal mask, or causal AND the packed-sequence check (a no-op for arange positions)
    q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    if isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor) or q_offset != 0 or kv_offset != 0:
        return False
    return kwargs["q_length"] == kwargs["kv_length"]


def sdpa_causal_mask(*args, **kwargs):
    """transformers' ``sdpa_mask`` (same arguments, same result), except that while ``torch.compile`` traces, a call
    that can only mean the causal mask of an unpadded, unpacked batch returns None (see the module docstring)."""
    if (torch.compiler.is_compiling() and not args and os.environ.get("FXREWRITE_COMPILE_CAUSAL_SKIP") != "0"
            and _can_skip(kwargs)):
        return None
    return masking_utils.sdpa_mask(*args, **kwargs)


def register_sdpa_causal() -> str:
    """Register ``fxrewrite_sdpa`` (transformers' SDPA attention, :func:`sdpa_causal_mask`) in transformers'
    attention and mask registries (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(SDPA_CAUSAL, sdpa_attention_forward)
    AttentionMaskInterface.register(SDPA_CAUSAL, sdpa_causal_mask)
    return SDPA_CAUSAL


def use_sdpa_causal(model: nn.Module) -> bool:
    """Switch a transformers causal LM attending through ``"sdpa"`` to ``fxrewrite_sdpa`` and hook its base model
    (:class:`_NoteCall`); True if it did (not when ``"sdpa"`` was registered anew, nor when its modeling code reads
    the name, :func:`sdpa_read_by_name`). ``_attn_implementation`` is not written by ``save_pretrained``."""
    config = getattr(model, "config", None)
    base = getattr(model, getattr(model, "base_model_prefix", "") or "", None)
    if (getattr(config, "_attn_implementation", None) != "sdpa" or getattr(config, "sub_configs", None)
            or not isinstance(base, nn.Module) or base is model or not _sdpa_is_transformers_own()
            or sdpa_read_by_name(model) is not None):
        return False
    config._attn_implementation = register_sdpa_causal()
    base.register_forward_pre_hook(_NoteCall(), with_kwargs=True)
    return True


def sdpa_read_by_name(model: nn.Module) -> str | None:
    """``"file:line"`` of the first place where the modeling code of `model`'s transformers classes compares
    ``_attn_implementation`` with ``"sdpa"`` (within three lines), or None. Such code (DeepSeek-V3.2's sparse
    indexer: ``if self.config._attn_implementation in ("eager", "sdpa"):`` builds its top-k mask) would take
    another branch under a renamed implementation, so the switch is refused there."""
    files = {inspect.getsourcefile(type(m)) for m in model.modules() if type(m).__module__.startswith("transformers.")}
    for path in sorted(f for f in files if f):
        lines = linecache.getlines(path)
        for i, line in enumerate(lines):
            if "_attn_implementation" in line and _SDPA_LITERAL.search("".join(lines[i:i + 3])):
                return f"{os.path.basename(path)}:{i + 1}"
    return None


_SDPA_LITERAL = re.compile(r"""["']sdpa["']""")


def _sdpa_is_transformers_own() -> bool:
    """Whether ``"sdpa"`` in transformers' attention and mask registries is still transformers' own function (a
    user may register another under that name; switching would drop it)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return (ALL_ATTENTION_FUNCTIONS.get("sdpa") is sdpa_attention_forward
            and ALL_MASK_ATTENTION_FUNCTIONS.get("sdpa") is masking_utils.sdpa_mask)
