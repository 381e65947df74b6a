"""Sampled tokens' logprobs: the engine's (`SamplingParams(logprobs=0)`) equal the trainer's recomputation
(`fxrewrite.rl.completion_logprobs` on the optimized model) in float32, and under `batch_invariant=True`
a sequence's logprobs are bitwise the same alone and batched with others."""

import pytest
import torch

import fxrewrite
from fxrewrite.rl import completion_logprobs
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM

PROMPTS = ["Hello, my name is", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17", "The capital", "a b c d e f"]


def _sampled(outputs):
    """[(prompt ids, completion ids, engine logprobs of the completion)] of every completion."""
    out = []
    for o in outputs:
        for c in o.outputs:
            lps = [step[t].logprob for t, step in zip(c.token_ids, c.logprobs)]
            out.append((list(o.prompt_token_ids), list(c.token_ids), lps))
    return out


@pytest.fixture(scope="module")
def path(tiny_model_dir):
    return str(tiny_model_dir("qwen3", vocab="smollm2"))


@pytest.mark.parametrize("impl", ["transformers", "native"])
def test_engine_logprobs_equal_trainer_recomputation_float32(path, impl):
    from transformers import AutoModelForCausalLM

    llm = LLM(path, model_impl=impl, dtype="float32", block_size=4, max_num_batched_tokens=16)  # chunked prefill
    params = SamplingParams(temperature=1.0, n=2, seed=3, logprobs=0, max_tokens=10, ignore_eos=True)
    samples = _sampled(llm.generate(PROMPTS, params, use_tqdm=False))
    trainer = fxrewrite.optimize(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    recomputed = completion_logprobs(trainer, [p for p, _, _ in samples], [c for _, c, _ in samples],
                                     micro_batch_size=3)
    for (_, _, engine), mine in zip(samples, recomputed):
        assert len(engine) == 10
        torch.testing.assert_close(torch.tensor(engine), mine.detach(), rtol=0, atol=1e-5)


def test_recomputation_has_gradients_and_checks_lengths(path):
    from transformers import AutoModelForCausalLM

    model = fxrewrite.optimize(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    lps = completion_logprobs(model, [[1, 2, 3]], [[4, 5]])
    lps[0].sum().backward()
    assert lps[0].shape == (2,) and model.model.norm.weight.grad is not None
    with pytest.raises(ValueError, match="prompts"):
        completion_logprobs(model, [[1]], [])


@pytest.mark.parametrize("impl", ["transformers", "native"])
def test_batch_invariant_logprobs_bitwise_alone_and_batched(path, impl):
    llm = LLM(path, model_impl=impl, dtype="float32", block_size=4, batch_invariant=True)
    target = SamplingParams(temperature=1.0, seed=11, logprobs=0, max_tokens=12, ignore_eos=True)
    alone = _sampled(llm.generate([PROMPTS[1]], target, use_tqdm=False))
    others = [SamplingParams(temperature=1.0, seed=s, logprobs=0, max_tokens=m, ignore_eos=True)
              for s, m in ((1, 5), (2, 16), (3, 9))]
    llm.reset_prefix_cache()  # the target's prompt is prefilled again, in a batch this time
    batched = _sampled(llm.generate(PROMPTS, [others[0], target, others[1], others[2]], use_tqdm=False))
    assert batched[1][1] == alone[0][1]
    assert batched[1][2] == alone[0][2]  # bitwise: float equality of every logprob
