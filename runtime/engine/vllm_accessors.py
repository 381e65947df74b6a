"""vLLM's `LLMEngine` accessors over what an engine here already holds, shared by `LLMEngine` and `DPLLMEngine`."""

from __future__ import annotations

__all__ = ["VLLMEngineAccessors"]


class VLLMEngineAccessors:
    """Mixin: `get_tokenizer`, `get_model_config`, `get_num_unfinished_requests` (vLLM's names). The class sets
    ``tokenizer`` and ``model_config``; ``requests`` (request id -> request) unless it overrides the count."""

    def get_tokenizer(self):
        """The engine's tokenizer (a transformers tokenizer)."""
        return self.tokenizer

    def get_model_config(self):
        """The engine's `ModelConfig`."""
        return self.model_config

    def get_num_unfinished_requests(self) -> int:
        """Requests queued, running, or finished but not yet returned by ``step``."""
        return len(self.requests)
