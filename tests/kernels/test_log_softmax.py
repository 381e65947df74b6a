"""`log_softmax_float32`: float32 logprobs accurate against float64 at a real vocabulary and a trained model's
spread of logits, bitwise the same for a row alone or batched, torch's gradients; and the contract it serves:
on the same logits, the engine's sampled-token logprob equals the trainer's chunked LM-head recomputation
(`fused_linear_logprobs`) within 1e-5 in float32 (the float32 CPU log_softmax alone missed it by 1.6e-5)."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels.batch_invariant import batch_invariant_mode
from fxrewrite.kernels.fused_linear_logprobs import fused_linear_logprobs
from fxrewrite.kernels.log_softmax import log_softmax_float32
from fxrewrite.runtime.engine.sampler import Sampler
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.sequence import Sequence

V = 49152  # the default model's (SmolLM2) vocabulary


def _spread_logits(rows: int, seed: int = 0) -> torch.Tensor:
    """Logits like a trained LM's: standard deviation 4 around 10 (SmolLM2's reach 30 and more)."""
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 4 + 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accurate_against_float64(dtype):
    x = _spread_logits(16).to(dtype)
    got = log_softmax_float32(x)
    truth = torch.log_softmax(x.double(), dim=-1)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert float((got.double() - truth).abs().max()) <= 3e-6


def test_row_alone_equals_row_batched_bitwise_and_in_batch_invariant_mode():
    x = _spread_logits(5, seed=1)
    batched = log_softmax_float32(x)
    for i in range(x.shape[0]):
        assert torch.equal(log_softmax_float32(x[i:i + 1]), batched[i:i + 1])
    with batch_invariant_mode():  # the mode's CPU log_softmax is this function too
        assert torch.equal(torch.log_softmax(x, dim=-1), batched)


def test_gradient_is_log_softmax_gradient_and_empty_input():
    x = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(2), requires_grad=True)
    y = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(3))
    (g,) = torch.autograd.grad((log_softmax_float32(x) * y).sum(), x)
    (want,) = torch.autograd.grad((torch.log_softmax(x.double(), -1) * y).sum(), x)
    torch.testing.assert_close(g, want.float(), rtol=1e-5, atol=1e-6)
    assert log_softmax_float32(torch.zeros(0, V)).shape == (0, V)


@pytest.mark.parametrize("vocab", [V, 151936])  # the default model's, Qwen3's
def test_engine_sampled_logprob_equals_trainer_recomputation_on_the_same_logits(vocab):
    """The sampler's reported logprob of its sampled token vs `fused_linear_logprobs` over the hidden states
    and LM head that give those logits (the trainer's logits-free path): float32, within 1e-5 per token."""
    gen = torch.Generator().manual_seed(4)
    rows, hidden_size = 48, 64
    hidden = torch.randn(rows, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen) * 0.6  # logits of standard deviation about 5
    logits = hidden @ weight.t()
    seqs = [Sequence(str(i), [1, 2, 3], SamplingParams(temperature=1.0, seed=i, logprobs=0)) for i in range(rows)]
    results = Sampler(set())(logits, seqs)
    tokens = torch.tensor([r.token_id for r in results])
    engine = torch.tensor([r.logprob for r in results])
    trainer = fused_linear_logprobs(hidden, weight, None, tokens)
    assert float(logits.std()) > 4.0
    torch.testing.assert_close(engine, trainer, rtol=0, atol=1e-5)
