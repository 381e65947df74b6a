"""Explicit table: HF architecture name -> native model class (module path, class name)."""

from __future__ import annotations

import importlib
import logging

from fxrewrite.errors import UserInputError

logger = logging.getLogger(__name__)

NATIVE_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("fxrewrite.runtime.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("fxrewrite.runtime.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("fxrewrite.runtime.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("fxrewrite.runtime.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("fxrewrite.runtime.models.qwen3_moe", "Qwen3MoeForCausalLM"),
}


def get_native_model_cls(architectures: list[str]):
    """The native class for the first listed architecture that has one, else None."""
    for arch in architectures or []:
        if arch in NATIVE_MODELS:
            module, name = NATIVE_MODELS[arch]
            return getattr(importlib.import_module(module), name)
    return None


def native_mismatch(model_config) -> str | None:
    """Why the native classes would not compute what transformers' model of this config computes (None: they
    do), for `model_impl="auto"` to pick the transformers backend instead (vLLM's auto falls back the same way
    for what its native classes do not support). The native Llama-family MLPs are SiLU-gated; their rotary is
    `get_rope`'s, which rotates `partial_rotary_factor` of each head, where transformers' Llama, Mistral, Qwen2,
    Qwen3 and Qwen3-MoE rotate the whole head and never read the factor."""
    cfg = model_config.hf_text_config
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        return f"hidden_act={act!r} (the native MLP is SiLU-gated)"
    factor = (model_config.rope_parameters or {}).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(cfg, "partial_rotary_factor", None)
    if factor is not None and factor != 1.0:
        return (f"partial_rotary_factor={factor} (transformers' {type(cfg).__name__} model rotates the whole "
                "head_dim and ignores it; the native one would rotate only that fraction)")
    return None


def resolve_model_impl(model_impl: str, model_config) -> str:
    """"native" or "transformers" for `model_impl`: "auto" picks native when the architecture has a native class
    that computes the config as transformers does (`native_mismatch`), else transformers. UserInputError for
    "native" without such a class."""
    native = get_native_model_cls(model_config.architectures)
    if model_impl == "native" and native is None:
        raise UserInputError(
            f"model_impl='native': no native implementation for {model_config.architectures}; native ones: "
            f"{sorted(NATIVE_MODELS)}; use model_impl='transformers' (or 'auto')"
        )
    mismatch = native_mismatch(model_config) if native is not None and model_impl != "transformers" else None
    if mismatch and model_impl == "native":
        raise UserInputError(
            f"model_impl='native': the native {native.__name__} does not compute this config as transformers "
            f"does: {mismatch}; use model_impl='transformers' (or 'auto', which picks it for this config)")
    if model_impl == "auto":
        if mismatch:
            logger.info("model_impl='auto': the transformers backend, not the native %s: %s", native.__name__, mismatch)
            return "transformers"
        return "native" if native is not None else "transformers"
    return model_impl
