"""FXREWRITE_DECODE_PROLOGUE=on (the native Qwen3's q/k norm + rotary + cache write inside the decode kernel) in an
engine with CUDA graphs and PDL: greedy tokens over short and split contexts, batch 1 and 8, equal the switch off's
(float32; the kernel comparison at bf16 sizes is tests/kernels/test_decode_prologue.py)."""

from __future__ import annotations

import random

import pytest

from fxrewrite.runtime.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("batch", [1, 8])
def test_prologue_in_graphs_gives_the_unfused_tokens(make_llm, monkeypatch, batch):
    rng = random.Random(batch)
    prompts = [[rng.randint(10, 10000) for _ in range(n)] for n in rng.sample([3, 40, 120, 300, 700, 900, 17, 64],
                                                                                batch)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for switch in ("off", "on"):
        monkeypatch.setenv("FXREWRITE_DECODE_PROLOGUE", switch)
        llm = make_llm(model_impl="native", dtype="float32", max_num_seqs=batch)
        tokens[switch] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["on"] == tokens["off"]
