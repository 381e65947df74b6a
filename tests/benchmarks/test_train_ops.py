"""Launch and byte counts of a training step on fake tensors (python -m fxrewrite.benchmarks.train_ops)."""

from __future__ import annotations

from fxrewrite.benchmarks.train_ops import count_step_ops, per_layer

TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 256, "vocab_size": 512, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}


def test_per_layer_counts_of_the_optimized_qwen3():
    """Per decoder layer, checkpointed: the fused q/k-norm + rotary runs once in the forward and again in the
    recompute, its backward once, and no contiguous copy (aten clone) is made in either direction."""
    runs = [count_step_ops(dict(TINY, num_hidden_layers=n), "optimize", batch_size=2, seq_len=16) for n in (1, 2)]
    layer = per_layer(*runs, 1)
    assert layer["forward:triton:_fwd_kernel"][0] == 1
    assert layer["backward:triton:_fwd_kernel"][0] == 1  # the checkpoint's recompute
    assert layer["backward:aten:mm"][0] >= 8  # four fused projections recomputed, two GEMMs each backward
    assert not any(key.endswith(":aten:clone") for key in layer)
    assert all(n > 0 and nbytes > 0 for key, (n, nbytes) in layer.items() if ":triton:" in key)
