"""Tiny models of real architectures (transformers' own config classes, random weights, float32)."""

import torch
import transformers as T

ARCHS = {
    "llama": (T.LlamaConfig, {}),
    "qwen2": (T.Qwen2Config, {}),
    "qwen3": (T.Qwen3Config, {"head_dim": 8}),
    "mistral": (T.MistralConfig, {}),
    "gemma2": (T.Gemma2Config, {"head_dim": 8}),
    "phi3": (T.Phi3Config, {"pad_token_id": 0}),
}


def tiny_config(arch: str, **overrides):
    cls, extra = ARCHS[arch]
    kwargs = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    kwargs.update(extra)
    kwargs.update(overrides)
    return cls(**kwargs)


def tiny_model(arch: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():  # norms start at 1 (or 0 for Gemma): randomise so a wrong offset shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5).add_(1.0 if arch != "gemma2" else 0.0)
    return model.eval()
