"""fxrewrite: stock transformers models, rewritten into fused layers, served by a paged-attention engine.

`import fxrewrite` stays light: the engine (`LLM`, `SamplingParams`) is imported on first use.
"""

from typing import Any

__all__ = ["optimize", "explain", "LLM", "SamplingParams", "RequestOutputKind", "StructuredOutputsParams",
           "PoolingParams", "TextPrompt", "TokensPrompt"]
__version__ = "0.1.0"


def optimize(model, **kwargs):
    """Rewrite `model` in place to use fused layers; see `fxrewrite.compiler.optimize`."""
    from fxrewrite.compiler import optimize as _optimize

    return _optimize(model, **kwargs)


def explain(model):
    """The `FusionReport` of a model passed through `optimize`; see `fxrewrite.compiler.explain`."""
    from fxrewrite.compiler import explain as _explain

    return _explain(model)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:  # `fxrewrite.rl.completion_logprobs(...)` after a plain `import fxrewrite`
        import importlib

        return importlib.import_module(f"fxrewrite.{name}")
    raise AttributeError(f"module 'fxrewrite' has no attribute {name!r}")


_LAZY = {  # name -> the module that defines it, imported on first use
    "LLM": "fxrewrite.runtime.llm",
    "SamplingParams": "fxrewrite.runtime.engine.sampling_params",
    "RequestOutputKind": "fxrewrite.runtime.engine.sampling_params",
    "StructuredOutputsParams": "fxrewrite.runtime.engine.structured_outputs",
    "PoolingParams": "fxrewrite.runtime.engine.pooling",
    "TextPrompt": "fxrewrite.runtime.llm_prompts",
    "TokensPrompt": "fxrewrite.runtime.llm_prompts",
}
_SUBMODULES = ("rl", "optimizer_state", "foreign", "kernels", "distributed", "layers", "patterns", "runtime",
               "benchmarks")
