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
                      ["glu", "lm_head_loss", "qkv", "residual_rms_norm", "rms_norm", "rotary_apply"], ["trace"]),
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
