"""Native Llama, also serving Qwen2 (bias on q/k/v) and Mistral (sliding window), from fused layers.

Parameter names follow the HF checkpoints except the fused ones (qkv_proj, gate_up_proj), which
`packed_modules_mapping` routes: the loader gives each shard to its parameter's weight_loader.
"""

from __future__ import annotations

import torch
from torch import nn

from fxrewrite.distributed import get_tp_rank, get_tp_size
from fxrewrite.errors import UserInputError
from fxrewrite.layers.activation import SiluAndMul
from fxrewrite.layers.fused_moe import FusedMoE
from fxrewrite.layers.layernorm import RMSNorm
from fxrewrite.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from fxrewrite.layers.rotary import get_rope
from fxrewrite.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from fxrewrite.runtime.worker.attention import Attention


def layer_sliding_window(cfg, layer_idx: int) -> int | None:
    """The layer's window: per `layer_types` when the config has them (Qwen2/3), else `sliding_window`
    for every layer (Mistral); None for full attention."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


def model_rope(model_config) -> nn.Module:
    """The model's RotaryEmbedding (cos/sin cache float32 [positions, rotary_dim]), built on the CPU."""
    cfg = model_config.hf_text_config
    return get_rope(model_config.head_dim, cfg.max_position_embeddings, model_config.rope_parameters, device="cpu")


class LlamaAttention(nn.Module):
    qkv_bias_default = False

    def __init__(self, model_config, layer_idx: int, device, rotary_emb: nn.Module | None = None):
        super().__init__()
        cfg = model_config.hf_text_config
        tp = {"tp_size": get_tp_size(), "tp_rank": get_tp_rank()}
        self.head_dim = model_config.head_dim
        qkv_bias = getattr(cfg, "attention_bias", self.qkv_bias_default) or self.qkv_bias_default
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, self.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, bias=qkv_bias,
            device=device, **tp,
        )
        self.qkv_proj.gemv_prologue = "norm"  # called through norm_forward: the input RMSNorm fused in at decode
        # Per rank: heads split across TP ranks, kv heads replicated when fewer than ranks.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        o_bias = getattr(cfg, "attention_bias", False) and not self.qkv_bias_default
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias=o_bias, device=device, **tp
        )
        self.rotary_emb = rotary_emb if rotary_emb is not None else model_rope(model_config)
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_idx,
            sliding_window=layer_sliding_window(cfg, layer_idx),
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, norm: nn.Module | None = None,
                residual: torch.Tensor | None = None):
        """hidden_states [T, H] -> [T, H]. With `norm` (the layer's input RMSNorm): hidden_states is the
        residual stream before it (plus `residual`, when given), normalised inside the QKV projection
        (`QKVParallelLinear.norm_forward`); returns (out, new residual)."""
        qkv, residual = self.project_qkv(hidden_states, norm, residual)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.position_qk(positions, q, k)
        out = self.o_proj(self.attn(q, k, v))
        return out if norm is None else (out, residual)

    def project_qkv(self, hidden_states: torch.Tensor, norm: nn.Module | None, residual: torch.Tensor | None):
        """(qkv [T, q + 2 kv], residual): the QKV projection, of norm(hidden_states, residual) when `norm` is given."""
        if norm is None:
            return self.qkv_proj(hidden_states), residual
        return self.qkv_proj.norm_forward(hidden_states, norm, residual)

    def position_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq*D], k [T, Hkv*D] -> rotated (Qwen3 adds its per-head norms here)."""
        return self.rotary_emb(positions, q, k)


class Qwen2Attention(LlamaAttention):
    qkv_bias_default = True


class LlamaMLP(nn.Module):
    def __init__(self, cfg, device):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        tp = {"tp_size": get_tp_size(), "tp_rank": get_tp_rank()}
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=bias, device=device, **tp
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias, device=device, **tp)
        self.gate_up_proj.gemv_prologue, self.down_proj.gemv_prologue = "norm", "silu"
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise UserInputError(f"hidden_act={cfg.hidden_act!r}: the native Llama supports only 'silu'")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None, residual: torch.Tensor | None = None):
        """x [T, H] -> [T, H]; with `norm` (post-attention RMSNorm) x is the stream before it, normalised
        inside gate_up_proj, and (out, new residual) is returned. At decode token counts the skinny GEMV
        also computes the activation inside down_proj where chosen (`RowParallelLinear.silu_forward`)."""
        if norm is None:
            return self.down_proj.silu_forward(self.gate_up_proj(x), self.act_fn)
        h, residual = self.gate_up_proj.norm_forward(x, norm, residual)
        return self.down_proj.silu_forward(h, self.act_fn), residual


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, model_config, layer_idx: int, device, rotary_emb: nn.Module | None = None):
        super().__init__()
        cfg = model_config.hf_text_config
        self.self_attn = self.attention_cls(model_config, layer_idx, device, rotary_emb)
        self.mlp = self.make_mlp(cfg, layer_idx, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_mlp(self, cfg, layer_idx: int, device) -> nn.Module:
        """This layer's MLP (a subclass returns an MoE block where its model has one): built once, so a layer
        never holds, even briefly, a dense MLP whose width its tensor-parallel shards need not divide."""
        return LlamaMLP(cfg, device)

    def forward(self, positions, hidden_states, residual):
        # Each RMSNorm (with its residual add) goes to the projection after it, which may fuse it into its GEMV.
        hidden_states, residual = self.self_attn(positions, hidden_states, self.input_layernorm, residual)
        if isinstance(self.mlp, LlamaMLP):
            return self.mlp(hidden_states, self.post_attention_layernorm, residual)
        if isinstance(self.mlp, FusedMoE) and residual is not None:  # the norm folds into the router launch
            return self.mlp.forward_norm(hidden_states, self.post_attention_layernorm, residual)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, model_config, layer_cls, device):
        super().__init__()
        cfg = model_config.hf_text_config
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, tp_size=get_tp_size(), tp_rank=get_tp_rank(), device=device
        )
        rotary_emb = model_rope(model_config)  # one cos/sin cache shared by every layer, as in vLLM
        self.layers = nn.ModuleList(
            layer_cls(model_config, i, device, rotary_emb) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T]) -> hidden [T, H]; compute_logits(hidden [S, H]) -> [S, V].

    Built with its large parameters on `device` (the engine passes "meta" and materialises later);
    norms and rotary caches are small and built on the CPU.
    """

    layer_cls = LlamaDecoderLayer
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, model_config, device="meta"):
        super().__init__()
        cfg = model_config.hf_text_config
        self.model = LlamaModel(model_config, self.layer_cls, device)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            cfg.vocab_size, cfg.hidden_size, tp_size=get_tp_size(), tp_rank=get_tp_rank(), device=device
        )
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen2DecoderLayer


MistralForCausalLM = LlamaForCausalLM
