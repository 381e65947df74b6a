"""The decode roofline's byte count: every weight for a dense model, only the routed experts for a MoE."""

from __future__ import annotations

import types

import pytest
import torch

from fxrewrite.benchmarks.common import engine_weight_bytes, expert_bytes, weight_bytes
from tests.moe.conftest import tiny_moe


def _engine(model):
    text = model.config
    config = types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1,
                                   enable_expert_parallel=False)
    return types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model), config=config,
                                 model_config=types.SimpleNamespace(hf_text_config=text))


def test_moe_step_reads_top_k_experts_at_batch_1():
    model = tiny_moe("qwen3_moe")  # 8 experts, top-2, 2 layers
    per_expert = 3 * 32 * 16 * 4  # gate, up, down of one expert, float32
    assert expert_bytes(model) == 2 * 8 * per_expert
    total = weight_bytes(model)
    engine = _engine(model)
    assert engine_weight_bytes(engine) == total
    assert engine_weight_bytes(engine, batch_size=1) == total - 2 * (8 - 2) * per_expert
    # a large batch touches (almost) every expert
    assert engine_weight_bytes(engine, batch_size=256) == pytest.approx(total, rel=1e-6)


def test_dense_model_counts_every_weight_at_any_batch():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(config).to(torch.float32)
    engine = _engine(model)
    assert expert_bytes(model) == 0
    assert engine_weight_bytes(engine, batch_size=1) == engine_weight_bytes(engine) == weight_bytes(model)


def test_native_model_leaves_out_its_untied_input_embedding():
    """The native models' VocabParallelEmbedding counts like transformers' Embedding (a few rows read)."""
    from fxrewrite.layers.vocab_embedding import VocabParallelEmbedding

    class Native(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = VocabParallelEmbedding(64, 16)
            self.lm_head = torch.nn.Linear(16, 64, bias=False)

    model = Native()
    assert weight_bytes(model) == 64 * 16 * 4
