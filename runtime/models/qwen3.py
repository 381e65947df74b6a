"""Native Qwen3: Llama's layout plus an RMSNorm over each head of q and k, before rotary."""

from __future__ import annotations

import torch
from torch import nn

from fxrewrite.kernels.qk_norm_rope import qk_norm_rope
from fxrewrite.kernels.qk_norm_rope_cache import qk_norm_rope_cache
from fxrewrite.layers.layernorm import RMSNorm
from fxrewrite.runtime.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from fxrewrite.runtime.worker.attention import layer_kv_cache


class Qwen3Attention(LlamaAttention):
    def __init__(self, model_config, layer_idx: int, device, rotary_emb=None):
        super().__init__(model_config, layer_idx, device, rotary_emb)
        eps = model_config.hf_text_config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, norm: nn.Module | None = None,
                residual: torch.Tensor | None = None):
        """Eagerly (CUDA graphs included), one kernel normalises and rotates q and k and writes k and v into
        this layer's paged cache (`qk_norm_rope_cache`: a launch per layer fewer than norm-rope + cache
        write). Under torch.compile, and for batch-dependent rotary, the unfused path: compile cannot trace
        the forward context (the cache write stays inside the attention custom op). `norm`, `residual`
        and the result as in `LlamaAttention.forward`."""
        if torch.compiler.is_compiling() or self.rotary_emb.rope_type in ("dynamic", "longrope"):
            return super().forward(positions, hidden_states, norm, residual)
        qkv, residual = self.project_qkv(hidden_states, norm, residual)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        rope = self.rotary_emb
        key_cache, value_cache, slot_mapping = layer_kv_cache(self.attn.layer_idx)
        q, k = qk_norm_rope_cache(positions, q, k, v, self.q_norm.weight, self.k_norm.weight,
                                  self.q_norm.variance_epsilon, self.head_dim, rope.cos_sin_cache, rope.is_neox_style,
                                  key_cache, value_cache, slot_mapping, static_metadata=True)
        out = self.o_proj(self.attn(q, k, v, kv_cached=True))
        return out if norm is None else (out, residual)

    def position_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq*D], k [T, Hkv*D]: normalise each head's D values (transformers' Qwen3 q_norm/k_norm),
        then rotate; one fused kernel (fxrewrite.kernels.qk_norm_rope) unless the rotary's cos/sin
        depend on the batch (dynamic NTK, longrope)."""
        rope = self.rotary_emb
        if rope.rope_type in ("dynamic", "longrope"):
            q = self.q_norm(q.view(-1, self.num_heads, self.head_dim)).view(q.shape)
            k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim)).view(k.shape)
            return rope(positions, q, k)
        return qk_norm_rope(positions, q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.variance_epsilon,
                            self.head_dim, rope.cos_sin_cache, rope.is_neox_style)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
