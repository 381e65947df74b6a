"""MoE test fixtures: tiny transformers MoE models of five families, and the interpreter fixture."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from tests.kernels.conftest import interpret  # noqa: F401  (re-exported fixture)

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "qwen3_moe": (T.Qwen3MoeConfig, dict(intermediate_size=48, moe_intermediate_size=16, head_dim=8, num_experts=8,
                                         norm_topk_prob=True)),
    "qwen2_moe": (T.Qwen2MoeConfig, dict(intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                                         shared_expert_intermediate_size=24)),
    "mixtral": (T.MixtralConfig, dict(intermediate_size=16, num_local_experts=4)),
    "olmoe": (T.OlmoeConfig, dict(intermediate_size=16, num_experts=8)),
    "granitemoe": (T.GraniteMoeConfig, dict(intermediate_size=16, num_local_experts=4)),  # softmax of the top-k logits
}


def tiny_moe(family: str, seed: int = 0, **overrides):
    """A float32 eval-mode MoE model with random weights (std 0.2 so routing depends on the input)."""
    cls, extra = FAMILIES[family]
    config = cls(**{**COMMON, **extra, "initializer_range": 0.2, **overrides})
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def expert_inputs(t=7, h=24, i=20, e=6, k=2, seed=0):
    """Random (x [t, h], w13 [e, 2i, h], w2 [e, h, i], routing weights [t, k], expert ids [t, k]), float32."""
    from fxrewrite.kernels.fused_moe import select_experts

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, 2 * i, h, generator=gen) * 0.2
    w2 = torch.randn(e, h, i, generator=gen) * 0.2
    weights, ids = select_experts(torch.randn(t, e, generator=gen), k, renormalize=True)
    return x, w13, w2, weights, ids


def stock_eager(model):
    """transformers' experts loop (the reference), whatever the default experts implementation is."""
    model.config._experts_implementation = "eager"
    return model


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture
def triton_on(interpret, monkeypatch):
    """Triton kernels in the interpreter, forced on (FXREWRITE_TRITON=1)."""
    monkeypatch.setenv("FXREWRITE_TRITON", "1")


class LaunchNames:
    """A `listen_launches` listener that records each kernel launch's name in `names`."""

    def __init__(self):
        self.names = []

    def enter_launch(self, name):
        self.names.append(name)

    def exit_launch(self, name):
        pass
