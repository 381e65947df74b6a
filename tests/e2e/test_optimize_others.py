"""Architectures outside the must-show list: whatever cannot be proved is refused, logits stay equal."""

import copy

import pytest
import torch
import transformers as T

import fxrewrite

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CASES = {
    # GPT-J style rotary: the cos/sin module is replaced, the interleaved apply call is refused
    "cohere": (T.CohereConfig, {}, ["glu", "lm_head_loss", "qkv", "rotary"], ["rotary_apply"]),
    # dynamic NTK: the rotary module's data-dependent branch stops its trace; the rest is fused
    "llama-dynamic": (T.LlamaConfig, {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
                      ["glu", "input_norm", "lm_head_loss", "qkv", "residual_rms_norm", "rms_norm", "rotary_apply"],
                      ["trace"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fail_closed_on_other_architectures(name):
    cls, extra, applied, refused = CASES[name]
    torch.manual_seed(0)
    stock = T.AutoModelForCausalLM.from_config(cls(**BASE, **extra)).eval()
    fused = fxrewrite.optimize(copy.deepcopy(stock))
    report = fxrewrite.explain(fused)
    assert report.applied_patterns() == applied
    assert sorted({p for _, p, _ in report.skipped()}) == refused
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-6)


def test_models_that_read_the_attention_name_keep_sdpa():
    """DeepSeek-V3.2's sparse indexer applies its top-k mask only under ``_attn_implementation in ("eager",
    "sdpa")``: the switch to fxrewrite_sdpa would make it attend densely (different logits with nothing fused), so
    it is refused there, and explain says where the name is read."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING["deepseek_v32"](
        vocab_size=96, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8, index_topk=4, index_head_dim=16,
        index_n_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)
    torch.manual_seed(0)
    stock = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    fused = fxrewrite.optimize(copy.deepcopy(stock))
    assert fused.config._attn_implementation == "sdpa"
    assert any("sdpa stays (modeling_deepseek_v32.py:" in note for note in fxrewrite.explain(fused).notes)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, stock(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["GraniteSWAConfig", "GraniteMoeSWAConfig"])
def test_rotary_replacement_answers_the_original_attributes(name):
    """GraniteSWA's model reads each rotary module's ``config.rope_parameters`` besides calling it: the replacement
    (RotaryCosSin) answers the original's plain attributes, so the optimized model runs and matches stock."""
    moe = dict(num_local_experts=4, num_experts_per_tok=2) if "Moe" in name else {}
    config = getattr(T, name)(**{**BASE, "num_key_value_heads": 2}, sliding_window=4, **moe)
    torch.manual_seed(0)
    stock = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    fused = fxrewrite.optimize(copy.deepcopy(stock))
    assert "rotary" in fxrewrite.explain(fused).applied_patterns()
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, stock(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
