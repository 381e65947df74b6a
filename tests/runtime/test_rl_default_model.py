"""The default model (SmolLM2-135M-Instruct, real weights, 30 layers, vocab 49,152) in float32: the engine's
sampled-token logprobs against the trainer's logits-free recomputation (`fxrewrite.rl.completion_logprobs` on
the optimized model). Before the engine's CPU logprobs were normalised in float64
(`fxrewrite.kernels.log_softmax`), the mean gap was 1.8e-5 (max 3.7e-5); now 2.3e-6 (max 1.2e-5).

The max is not asserted at 1e-5: the prompt's hidden states are bitwise the trainer's, but each decode step
attends with the engine's own kernel, and in float32 two correct attention kernels move this model's logprobs
by up to 1.3e-5 (the trainer alone, sdpa against eager attention: mean 2.2e-6, max 1.3e-5); against float64,
either side is off by up to 4e-5. The tiny-model test (tests/runtime/test_rl_logprobs.py) holds every token
to 1e-5, and tests/kernels/test_log_softmax.py holds the logprob of the same logits to 1e-5 per token."""

import pytest
import torch

import fxrewrite
from fxrewrite.rl import completion_logprobs
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM

pytestmark = pytest.mark.slow

PROMPTS = ["Hello, my name is", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17", "The capital", "a b c d e f"]


def test_default_model_engine_logprobs_equal_trainer_float32(default_model_dir):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(default_model_dir), model_impl="transformers", dtype="float32", max_model_len=256,
              enforce_eager=True)
    params = SamplingParams(temperature=1.0, n=2, seed=3, logprobs=0, max_tokens=16, ignore_eos=True)
    prompts, completions, engine = [], [], []
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        for c in out.outputs:
            prompts.append(list(out.prompt_token_ids))
            completions.append(list(c.token_ids))
            engine += [step[t].logprob for t, step in zip(c.token_ids, c.logprobs)]
    del llm
    trainer = fxrewrite.optimize(AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32))
    with torch.no_grad():
        mine = torch.cat(completion_logprobs(trainer, prompts, completions, micro_batch_size=3))
    gap = (torch.tensor(engine) - mine).abs()
    assert gap.numel() == 128
    assert float(gap.mean()) <= 1e-5, f"mean {float(gap.mean()):.2e}, max {float(gap.max()):.2e}"
