"""Native Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with a sparse MoE block per layer.

The MoE block is `FusedMoE`: router ``mlp.gate`` [E, H] (replicated), experts ``mlp.experts``
(`FusedExperts`: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], transformers 5's names, so
per-expert checkpoints load through transformers' conversion rules), softmax top-k with
``norm_topk_prob``. Layers listed in ``mlp_only_layers``, or off the ``decoder_sparse_step`` grid,
keep a dense gated MLP, as in transformers' ``Qwen3MoeDecoderLayer``. Tensor parallel splits each
expert's columns; with expert parallelism (`fxrewrite.distributed.set_expert_parallel`) whole
experts are split across the ranks.
"""

from __future__ import annotations

from torch import nn

from fxrewrite.data_parallel import moe_parallel
from fxrewrite.errors import UserInputError
from fxrewrite.layers.fused_moe import FusedExperts, FusedMoE
from fxrewrite.layers.linear import ReplicatedLinear
from fxrewrite.runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from fxrewrite.runtime.models.qwen3 import Qwen3Attention


def is_moe_layer(cfg, layer_idx: int) -> bool:
    """transformers' rule: not in mlp_only_layers, experts present, (layer_idx + 1) % decoder_sparse_step == 0."""
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(cfg, "mlp_only_layers", None) or []) and cfg.num_experts > 0
            and (layer_idx + 1) % step == 0)


def moe_block(cfg, device) -> FusedMoE:
    """The sparse MoE block of one layer (router `gate`, experts `experts`)."""
    if cfg.hidden_act != "silu":
        raise UserInputError(f"hidden_act={cfg.hidden_act!r}: the native Qwen3-MoE supports only 'silu'")
    router = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, bias=False, device=device)
    size, rank, expert_parallel = moe_parallel()  # the TP group, or every DP x TP worker under DP + EP
    experts = FusedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, tp_size=size,
                           tp_rank=rank, expert_parallel=expert_parallel, device=device)
    return FusedMoE({"router": "gate", "experts": "experts"}, {"router": router, "experts": experts},
                    top_k=cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention

    def make_mlp(self, cfg, layer_idx: int, device) -> nn.Module:
        return moe_block(cfg, device) if is_moe_layer(cfg, layer_idx) else LlamaMLP(cfg, device)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """forward(input_ids [T], positions [T]) -> hidden [T, H]; compute_logits -> [S, V] (see LlamaForCausalLM)."""

    layer_cls = Qwen3MoeDecoderLayer
    model_type = "qwen3_moe"  # checkpoint conversion rules (per-expert tensors -> gate_up_proj/down_proj)
    # Dotted keys: "up_proj" alone would also match the experts' "gate_up_proj".
    packed_modules_mapping = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }
