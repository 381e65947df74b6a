"""A module-scope replacement is refused when the module's forward computes something else in the other mode
(`fxrewrite.train_eval`): Mixtral's router jitter, traced in eval mode, must not vanish in train mode."""

import copy

import torch
import transformers as T
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import fxrewrite
from fxrewrite.layers.layernorm import RMSNorm


def _mixtral(jitter: float):
    config = T.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                             router_jitter_noise=jitter)
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()  # as from_pretrained returns it


def test_router_jitter_keeps_the_moe_block_and_train_mode_matches_stock():
    model = _mixtral(0.5)
    ref = copy.deepcopy(model).train()
    fxrewrite.optimize(model).train()
    skipped = [r for _, p, r in fxrewrite.explain(model).skipped() if p == "moe"]
    assert skipped and "self.training" in skipped[0], fxrewrite.explain(model).skipped()
    ids = torch.tensor([[3, 9, 27, 40, 5]])
    with torch.no_grad():
        torch.manual_seed(1)
        want = ref(ids).logits
        torch.manual_seed(1)
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_without_jitter_the_moe_block_is_fused():
    model = fxrewrite.optimize(_mixtral(0.0))
    assert "moe" in fxrewrite.explain(model).applied_patterns()


class ScaledInTraining(LlamaRMSNorm):
    def forward(self, hidden_states):
        if self.training:
            hidden_states = hidden_states * 2.0
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def test_norm_with_a_training_branch_is_left_alone():
    norm = ScaledInTraining(8).eval()
    holder = torch.nn.Sequential(norm)
    fxrewrite.optimize(holder, example_inputs=((torch.randn(2, 8),), {}))
    assert type(holder[0]) is ScaledInTraining and not isinstance(holder[0], RMSNorm)
    assert any(p == "rms_norm" and "train mode" in r for _, p, r in fxrewrite.explain(holder).skipped())
