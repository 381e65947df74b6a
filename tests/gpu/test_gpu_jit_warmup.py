"""After the engine's load-time warm-up, serving builds no Triton kernel: prompts of every length class
(1 token, multiples of 16 and not, chunked prefill, mixed prefill + decode steps, long contexts that
split the decode kernel), batch sizes that change the decode bucket, eager and CUDA-graph engines."""

from __future__ import annotations

import random

import pytest

from fxrewrite.kernels.triton_utils import watch_jit_compiles
from fxrewrite.runtime.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


def _workload(seed: int):
    rng = random.Random(seed)
    lens = [1, 2, 15, 16, 17, 31, 32, 33, 100, 257, 700, 900] + [rng.randint(1, 900) for _ in range(20)]
    prompts = [[rng.randint(10, 10000) for _ in range(n)] for n in lens]
    params = [SamplingParams(temperature=0, max_tokens=rng.choice([1, 3, 40, 100]), ignore_eos=True) for _ in lens]
    return prompts, params


@pytest.mark.parametrize("impl", ["native", "transformers"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_no_triton_jit_after_load(make_llm, impl, enforce_eager):
    llm = make_llm(model_impl=impl, dtype="bfloat16", enforce_eager=enforce_eager, max_num_batched_tokens=512,
                   max_num_seqs=64)
    assert llm.llm_engine.model_runner.warmup_compiles is not None
    for seed in (1, 2):
        prompts, params = _workload(seed)
        with watch_jit_compiles() as built:
            llm.generate(prompts, params, use_tqdm=False)
        assert built == [], f"Triton built {len(built)} kernels while serving: {built[:4]}"


def test_watcher_sees_a_new_kernel():
    """The watcher itself: a kernel never launched before is reported once, not on its second launch."""
    import torch

    from fxrewrite.kernels.triton_utils import tl, triton

    @triton.jit
    def _fill(ptr, value, BLOCK: tl.constexpr):
        tl.store(ptr + tl.arange(0, BLOCK), value)

    out = torch.empty(16, device="cuda")
    with watch_jit_compiles() as built:
        _fill[(1,)](out, 3.0, BLOCK=16)
        _fill[(1,)](out, 4.0, BLOCK=16)
    assert len(built) == 1 and "_fill" in built[0] and out[0].item() == 4.0
