"""The fake-tensor peak-memory simulator of a training step (python -m fxrewrite.benchmarks.train_memory)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxrewrite.benchmarks.train_memory import LiveBytes, simulate_step_memory

TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 256, "vocab_size": 512, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}


def test_live_bytes_counts_storages_once_and_frees_them():
    tracker = LiveBytes()
    with FakeTensorMode(), tracker:
        a = torch.empty(256, dtype=torch.float32)  # 1 KiB
        view = a[:10]
        a.add_(1.0)  # in place: no new storage
        b = a * 2  # a new KiB
        assert tracker.live == 2048
        del a, b
        assert tracker.live == 1024  # the view keeps a's storage alive
        del view
    assert tracker.live == 0 and tracker.peak == 2048


def test_simulated_step_stock_vs_optimize():
    """Stock holds the float32 [tokens, vocab] logits (log-softmax and its gradient) at its peak; the optimized
    model never makes them (fused linear cross-entropy), so its peak is lower by about that much."""
    tokens = 2 * 64
    stock = simulate_step_memory(TINY, "stock", batch_size=2, seq_len=64, steps=1)
    fused = simulate_step_memory(TINY, "optimize", batch_size=2, seq_len=64, steps=1)
    logits = tokens * TINY["vocab_size"] * 4
    for result in (stock, fused):
        assert len(result["steps"]) == 1
        step = result["steps"][-1]
        assert step["peak_bytes"] > 4 * result["parameter_bytes"]  # weights, gradients, two AdamW moments
        assert set(step["phase_peaks"]) >= {"forward", "backward"}
    assert stock["steps"][-1]["at_peak"].get("forward:_log_softmax", 0) >= logits
    assert not any("log_softmax" in label for label in fused["steps"][-1]["at_peak"])
    assert stock["steps"][-1]["peak_bytes"] - fused["steps"][-1]["peak_bytes"] >= logits


def test_unpadded_path_as_on_real_tensors():
    """By default no 4D mask is built and SDPA takes k and v unrepeated (``enable_gqa``), as in an eager run on real
    tensors without padding; ``padding_mask`` keeps transformers' fake-tensor path (a mask, k/v repeated by copies)."""
    def labels(result):
        return {label for phase in result["steps"][-1]["at_phase_peak"].values() for label in phase["live"]}

    plain = simulate_step_memory(TINY, "stock", batch_size=2, seq_len=64, steps=1, gradient_checkpointing=False)
    padded = simulate_step_memory(TINY, "stock", batch_size=2, seq_len=64, steps=1, gradient_checkpointing=False,
                                  padding_mask=True)
    assert not any(label.endswith("self_attn:clone") for label in labels(plain))
    assert any(label.endswith("self_attn:clone") for label in labels(padded))
