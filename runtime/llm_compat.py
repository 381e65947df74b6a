"""vLLM's `LLM` surface that this engine does not have: the `generate` / `chat` keyword arguments, accepted at
vLLM's defaults and refused (naming the feature) otherwise, and the vLLM methods `LLM` lacks, which raise
NotImplementedError naming what to use instead (not a bare AttributeError)."""

from __future__ import annotations

from typing import Any

from fxrewrite.errors import UserInputError, UserTypeError, is_integer

CHAT_TEMPLATE_CONTENT_FORMATS = ("auto", "string", "openai")
"""vLLM's chat_template_content_format values: "string" gives the template each message's text parts joined into
one string (what "auto" does here), "openai" gives it the list of {"type": "text", "text": ...} parts."""


def check_request_kwargs(method: str, num_prompts: int, *, lora_request: Any = None, priority: Any = None,
                         tokenization_kwargs: Any = None, mm_processor_kwargs: Any = None) -> None:
    """vLLM's `LLM.generate` / `LLM.chat` keyword arguments for features this engine lacks: accepted at vLLM's
    defaults (None; priority all zeros, one per prompt; an empty dict), else NotImplementedError naming the
    argument, the feature and what to do instead (UserTypeError / UserInputError for a malformed priority)."""
    if lora_request is not None:
        raise NotImplementedError(f"LLM.{method}(lora_request={lora_request!r:.80}): LoRA adapters are not "
                                  "supported by fxrewrite's engine; merge the adapter into the weights (PEFT's "
                                  "merge_and_unload()) and load the merged model")
    if priority is not None:
        _check_priority(method, priority, num_prompts)
    for name, value, why in (
            ("tokenization_kwargs", tokenization_kwargs, "tokenize the prompts yourself and pass token ids "
                                                         "({'prompt_token_ids': [...]})"),
            ("mm_processor_kwargs", mm_processor_kwargs, "there is no multi-modal processor: the engine serves "
                                                         "text-only decoder models")):
        if value is not None and not isinstance(value, dict):
            raise UserTypeError(f"LLM.{method}({name}={value!r:.80}): expected None or a dict")
        if value:
            raise NotImplementedError(f"LLM.{method}({name}={value!r:.80}) is not supported; {why}")


def _check_priority(method: str, priority: Any, num_prompts: int) -> None:
    if not isinstance(priority, (list, tuple)) or not all(is_integer(p) for p in priority):
        raise UserTypeError(f"LLM.{method}(priority={priority!r:.80}): expected None or a list of integers, "
                            "one per prompt")
    if len(priority) != num_prompts:
        raise UserInputError(f"LLM.{method}(priority=...): got {len(priority)} priorities for {num_prompts} "
                             "prompts; expected one per prompt")
    if any(priority):
        raise NotImplementedError(f"LLM.{method}(priority={list(priority)!r:.80}): priority scheduling is not "
                                  "supported; the scheduler is first-come-first-served (vLLM's "
                                  "scheduling_policy='fcfs'), so every priority must be 0 (or None)")


def check_content_format(value: Any) -> str:
    """chat_template_content_format: one of `CHAT_TEMPLATE_CONTENT_FORMATS` ("auto" is "string" here),
    UserInputError naming the value otherwise."""
    if value not in CHAT_TEMPLATE_CONTENT_FORMATS:
        raise UserInputError(f"chat_template_content_format={value!r}: expected 'auto', 'string' (text parts "
                             "joined into one string, what 'auto' does here) or 'openai' (the list of text parts)")
    return "string" if value == "auto" else value


UNSUPPORTED_METHODS = {
    "beam_search": "beam search is not implemented; use LLM.generate (sampling, or temperature=0 for greedy; n "
                   "for several samples)",
    "encode": "use LLM.embed with LLM(model, runner='pooling') (the last token's normalised hidden state)",
    "classify": "classification models are not served; LLM.embed with runner='pooling' gives embeddings",
    "reward": "reward models are not served; LLM.embed with runner='pooling' gives embeddings",
    "collective_rpc": "the engine's workers take no RPCs; use LLM.load_weights, sleep, wake_up and "
                      "reset_prefix_cache, or llm.llm_engine",
    "apply_model": "the engine's workers take no functions; use llm.llm_engine, or LLM.load_weights to change "
                   "the weights",
    "get_metrics": "the offline LLM keeps no Prometheus metrics; use `fxrewrite serve`, which exports them at "
                   "/metrics",
}
"""vLLM `LLM` methods with no counterpart here -> what to use instead (`with_unsupported_methods` adds them)."""


def with_unsupported_methods(cls: type) -> type:
    """Class decorator: each of `UNSUPPORTED_METHODS` becomes a method raising NotImplementedError that names it
    and what to use instead (methods, not `__getattr__`: `hasattr` stays true, as on vLLM's LLM)."""
    for name, why in UNSUPPORTED_METHODS.items():
        setattr(cls, name, _unsupported(name, why))
    return cls


def _unsupported(name: str, why: str):
    def method(self, *args: Any, **kwargs: Any):
        raise NotImplementedError(f"LLM.{name} (vLLM's) is not supported by fxrewrite: {why}")

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Not supported: raises NotImplementedError ({why})."
    return method
