"""The L2 weight prefetch beside attention (`FXREWRITE_L2_PREFETCH_MB`, `fxrewrite.layers.weight_prefetch`) on the GPU:
the kernel runs over bf16 and FP8 weights, partial budgets included, and the native engine captures its decode
CUDA graphs with the side stream forked and joined, giving bitwise the tokens and log-probabilities of the engine
without it. CPU tests: tests/layers/test_weight_prefetch.py."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels.l2_prefetch import l2_prefetch_triton
from fxrewrite.runtime.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("nbytes", [1, 100_000, 1 << 30])
def test_kernel_runs_and_writes_nothing(dtype, nbytes):
    w = torch.randn(2560, 4096, device="cuda").to(dtype)
    before = w.view(torch.uint8).clone()
    l2_prefetch_triton(w, nbytes)
    torch.cuda.synchronize()
    assert torch.equal(w.view(torch.uint8), before)


def test_engine_with_prefetch_equals_without(make_llm, monkeypatch):
    prompts = [[i + 1 for i in range(40)], [7] * 5, list(range(100, 300))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    runs = {}
    for mb in ("0", "32"):
        monkeypatch.setenv("FXREWRITE_L2_PREFETCH_MB", mb)
        llm = make_llm(model_impl="native", compilation_config=0)
        assert llm.llm_engine.model_runner.graph_runner.graphs  # decode steps replay captured graphs
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[mb] = [[(t, lp[t].logprob) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                    for o in outs]
        del llm
    assert runs["32"] == runs["0"]
