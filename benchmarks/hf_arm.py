"""The outside peer: stock transformers continuous batching (`model.generate_batch`), paged|sdpa.

The model is built from the same config with transformers' own random init (no weights exist here)
in bf16 on the GPU. `generate_batch` takes one `max_new_tokens` for every request, so this arm gets
the workload's prompts with max_new_tokens = the mean of their output lengths (recorded), greedy.
It may get fewer prompts than the engine arms (recorded as `num_prompts`) to bound its run time.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path


def _supported(fn, **kwargs) -> dict:
    """The keyword arguments `fn` accepts (generate_batch's signature differs between versions)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def build_hf_model(model_dir: Path, device: str = "cuda", dtype: str = "auto"):
    """The transformers model of `model_dir` (random weights) on `device`, in `dtype` resolved as the engine
    resolves it (`resolve_dtype`: "auto" is the config's dtype), so that the hf arm runs what the engine arms run."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fxrewrite.runtime.model_files.config import resolve_dtype

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype, config), attn_implementation="sdpa")
    return model.eval()


def run_hf_throughput(model_dir: Path, prompts: list[list[int]], output_lens: list[int], device: str = "cuda",
                      dtype: str = "auto") -> dict:
    """Time one `generate_batch` over `prompts` after a two-prompt warm-up call."""
    import torch
    from transformers import GenerationConfig

    model = build_hf_model(model_dir, device, dtype)
    max_new = round(sum(output_lens) / len(output_lens))
    gen = GenerationConfig(max_new_tokens=max_new, do_sample=False)
    warm = GenerationConfig(max_new_tokens=8, do_sample=False)
    # No inference_mode here: generate_batch runs its loop in a thread of its own, which would then
    # update tensors made in inference mode outside it (a RuntimeError in transformers 5.17).
    model.generate_batch(**_supported(model.generate_batch, inputs=prompts[:2], generation_config=warm,
                                      progress_bar=False))
    _sync(device)
    start = time.perf_counter()
    results = model.generate_batch(**_supported(model.generate_batch, inputs=prompts, generation_config=gen,
                                                progress_bar=False))
    _sync(device)
    elapsed = time.perf_counter() - start
    outputs = list(results.values())
    output_tokens = sum(len(r.generated_tokens) for r in outputs)
    errors = [r.error for r in outputs if getattr(r, "error", None)]
    dtype = str(model.dtype).removeprefix("torch.")
    del model
    return {
        "output_tokens": output_tokens,
        "prompt_tokens": sum(map(len, prompts)),
        "elapsed_s": round(elapsed, 6),  # microseconds: the ratios are computed from it
        "output_tokens_per_s": round(output_tokens / elapsed, 1),
        "num_finished": len(outputs),
        "num_requests": len(prompts),
        "dtype": dtype,
        "max_new_tokens": max_new,
        "attn_implementation": "sdpa (generate_batch switches to paged|sdpa)",
        "errors": errors[:3],
    }


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
