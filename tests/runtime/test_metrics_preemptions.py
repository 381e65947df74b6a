"""`fxrewrite:num_preemptions_total` (vLLM's vllm:num_preemptions_total): fed from the engine's count after a step."""

import torch

from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.server.metrics import ServerMetrics
from fxrewrite.runtime.worker.kv_cache import bytes_per_block


def _preemptions(metrics: ServerMetrics) -> float:
    return metrics.registry.get_sample_value("fxrewrite:num_preemptions_total", {"model_name": "m"})


def test_preemptions_with_a_tiny_kv_cache_increment_the_counter(tiny_qwen3_dir):
    from fxrewrite.runtime.model_files.config import ModelConfig

    path = str(tiny_qwen3_dir)
    block_bytes = bytes_per_block(ModelConfig.from_pretrained(path, dtype="float32"), 4, torch.float32)
    llm = LLM(path, model_impl="native", dtype="float32", block_size=4, kv_cache_memory_bytes=8 * block_bytes,
              max_num_batched_tokens=8)
    metrics = ServerMetrics("m")
    metrics.update_engine_stats(llm.llm_engine.get_stats())
    assert _preemptions(metrics) == 0
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate(["Hello, my name is", "The capital of France is", "1 2 3 4 5"], params, use_tqdm=False)
    count = llm.llm_engine.get_stats()["num_preemptions"]
    assert count > 0
    metrics.update_engine_stats(llm.llm_engine.get_stats())
    metrics.update_engine_stats(llm.llm_engine.get_stats())  # the same count again adds nothing
    assert _preemptions(metrics) == count

