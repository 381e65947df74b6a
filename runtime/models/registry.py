"""Explicit table: HF architecture name -> native model class (module path, class name)."""

from __future__ import annotations

import importlib

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
