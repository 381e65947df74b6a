"""Pipeline parallelism on 2 GPUs (NCCL send/recv between the stages, CUDA graphs on each): greedy
tokens of `LLM(pipeline_parallel_size=2)` equal one GPU's in float32, native and transformers + fusion.
PP sends the same hidden states a single GPU computes, so (unlike TP's split all-reduce sums) the
tokens must match exactly."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h200-x2)"),
]

PROMPTS = [list(range(100, 140)), [7, 8, 9], list(range(1000, 1300))]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from fxrewrite.runtime.model_files.demo import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("qwen3"), "qwen3", hidden_size=512, num_attention_heads=8,
                           head_dim=64, intermediate_size=1024, num_hidden_layers=3, num_key_value_heads=2,
                           vocab="qwen3")


def _generate(path, impl: str, pp: int):
    from fxrewrite.runtime.engine.sampling_params import SamplingParams
    from fxrewrite.runtime.llm import LLM

    llm = LLM(str(path), model_impl=impl, dtype="float32", pipeline_parallel_size=pp, max_model_len=1024,
              kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=256)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
        if pp > 1:  # the stages overlapped: a second micro-batch was sent before the first returned
            assert llm.llm_engine.micro_batches.max_in_flight == pp
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        if pp > 1:
            llm.llm_engine.model_runner.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_pp2_greedy_equals_one_gpu(model_dir, impl):
    assert _generate(model_dir, impl, 2) == _generate(model_dir, impl, 1)
