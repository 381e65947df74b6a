"""A Llama whose attention class is defined here, outside transformers, calling the `apply_rotary_pos_emb` it imports
from transformers' Llama file (as remote-code models do; on transformers >= 5.25 that name is a `kernels`-decorated
module instance, before a plain function the trace goes through), with a hook between attention and o_proj that
tests override (tests/patterns/test_feature_path.py)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb, eager_attention_forward

CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)


class ImportingAttention(LlamaAttention):
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                    eager_attention_forward)
        attn_output, attn_weights = attention_interface(self, query_states, key_states, value_states, attention_mask,
                                                        dropout=0.0, scaling=self.scaling)
        return self.o_proj(self.merge_heads(attn_output, input_shape)), attn_weights

    def merge_heads(self, attn_output, input_shape):
        """The attention output [B, S, H, D] -> o_proj's input [B, S, H * D]."""
        return attn_output.reshape(*input_shape, -1).contiguous()


class ModuleAttributeAttention(ImportingAttention):
    """The same, reaching the function as an attribute of transformers' module (``modeling_llama.apply_...``)."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = modeling_llama.apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                    eager_attention_forward)
        attn_output, attn_weights = attention_interface(self, query_states, key_states, value_states, attention_mask,
                                                        dropout=0.0, scaling=self.scaling)
        return self.o_proj(self.merge_heads(attn_output, input_shape)), attn_weights


def custom_llama(seed: int = 0, attention=ImportingAttention, mlp=None, num_hidden_layers: int = 2,
                 **extra_params: torch.Tensor) -> LlamaForCausalLM:
    """A tiny float32 Llama (4 heads of 8, 2 kv heads) whose attentions are `attention` instances (and MLPs `mlp`
    ones, built as LlamaMLP), the stock weights loaded; `extra_params` become parameters of both."""
    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=num_hidden_layers, **CONFIG)
    model = LlamaForCausalLM(config).eval()
    for i, layer in enumerate(model.model.layers):
        for name, cls, args in (("self_attn", attention, (config, i)), ("mlp", mlp, (config,))):
            if cls is None:
                continue
            new = cls(*args)
            for key, value in extra_params.items():
                new.register_parameter(key, torch.nn.Parameter(value.clone()))
            new.load_state_dict(getattr(layer, name).state_dict(), strict=False)
            setattr(layer, name, new)
    return model
