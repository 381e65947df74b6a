"""fxrewrite: stock transformers models, rewritten into fused layers, served by a paged-attention engine.

`import fxrewrite` stays light: the engine (`LLM`, `SamplingParams`) is imported on first use.
"""

from typing import Any

__all__ = ["optimize", "explain", "LLM", "SamplingParams", "StructuredOutputsParams", "PoolingParams"]
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
    if name == "LLM":
        from fxrewrite.runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from fxrewrite.runtime.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from fxrewrite.runtime.engine.structured_outputs import StructuredOutputsParams

        return StructuredOutputsParams
    if name == "PoolingParams":
        from fxrewrite.runtime.engine.pooling import PoolingParams

        return PoolingParams
    if name in _SUBMODULES:  # `fxrewrite.rl.completion_logprobs(...)` after a plain `import fxrewrite`
        import importlib

        return importlib.import_module(f"fxrewrite.{name}")
    raise AttributeError(f"module 'fxrewrite' has no attribute {name!r}")


_SUBMODULES = ("rl", "optimizer_state", "foreign", "kernels", "distributed", "layers", "patterns", "runtime",
               "benchmarks")
