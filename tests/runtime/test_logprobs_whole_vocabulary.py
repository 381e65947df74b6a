"""vLLM's logprobs=-1 / prompt_logprobs=-1: every token's logprob (a fresh user found -1 refused outright)."""

import pytest
import torch

from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM


@pytest.mark.parametrize("max_logprobs", [20, -1])
def test_logprobs_minus_one_is_the_whole_vocabulary(tiny_qwen3_dir, max_logprobs):
    """Allowed by max_logprobs=-1; with the default limit (20) the refusal names -1 and what it stands for."""
    llm = LLM(str(tiny_qwen3_dir), model_impl="native", dtype="float32", block_size=4, max_logprobs=max_logprobs)
    vocab = llm.llm_engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=-1)
    if max_logprobs == 20:
        with pytest.raises(ValueError, match=rf"logprobs=-1 \(the whole vocabulary, {vocab}\) is more than "
                                             "max_logprobs=20"):
            llm.generate([[1, 2, 3]], params, use_tqdm=False)
        return
    (out,) = llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert params.logprobs == params.prompt_logprobs == -1  # the caller's object is left as it was
    assert [len(step) for step in out.outputs[0].logprobs] == [vocab, vocab]
    assert out.prompt_logprobs[0] is None and [len(p) for p in out.prompt_logprobs[1:]] == [vocab, vocab]
    total = torch.logsumexp(torch.tensor([lp.logprob for lp in out.outputs[0].logprobs[0].values()]), 0)
    assert abs(float(total)) < 1e-3  # a whole distribution
