"""Length-dependent RoPE in the engine equals transformers' own generate, whatever shares the step
(issue 15 items 2 and 3): LongRoPE (Phi-3) before, across and after the switch at
original_max_position_embeddings, and dynamic NTK (Llama), on the transformers and native paths."""

import pytest
import torch

from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM

LONGROPE = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.7 * i for i in range(8)]}
PHI3 = dict(max_position_embeddings=256, original_max_position_embeddings=64, rope_parameters=LONGROPE,
            vocab_size=49152, pad_token_id=0)
DYNAMIC = dict(max_position_embeddings=32, rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 100.0})


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own generation of one sequence (a fresh model: its rotary is stateful): cached, except
    for LongRoPE. Phi-3's cached generation is meant to drop the short-factor cache and recompute everything
    with the long factors at the switch; transformers 5.17 keeps the cache there (its base
    prepare_inputs_for_generation still feeds one token), a bug later versions fixed (5.24 recomputes all 65
    tokens). Uncached generation computes every step with the factors of its length on every version,
    which is what the fixed cached generation computes too."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    longrope = (getattr(model.config, "rope_parameters", None) or {}).get("rope_type") == "longrope"
    ids = torch.tensor([prompt])
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0, use_cache=not longrope)
    return gen[0, len(prompt):].tolist()


def engine_greedy(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def phi3_dir(tiny_model_dir):
    return str(tiny_model_dir("phi3", **PHI3))


@pytest.mark.parametrize("fusion", [True, False])
def test_longrope_neighbour_and_switch_equal_transformers(phi3_dir, fusion):
    short, long_, crossing = _prompt(20, 1), _prompt(120, 2), _prompt(50, 3)
    want_short, want_long = hf_greedy(phi3_dir, short, 8), hf_greedy(phi3_dir, long_, 8)
    want_crossing = hf_greedy(phi3_dir, crossing, 60)  # positions 50..109: the switch at 64
    llm = LLM(phi3_dir, model_impl="transformers", fusion=fusion, dtype="float32", block_size=4)
    assert engine_greedy(llm, [short], [8]) == [want_short]  # alone
    assert engine_greedy(llm, [short, long_], [8, 8]) == [want_short, want_long]  # one step together
    assert engine_greedy(llm, [crossing], [60]) == [want_crossing]
    # Across the switch with a long neighbour, and again (the prefix cache must not serve short-factor KV).
    assert engine_greedy(llm, [crossing, long_], [60, 8]) == [want_crossing, want_long]
    extended = crossing + _prompt(20, 6)  # long from the start: its cached 50-token prefix was short
    assert engine_greedy(llm, [extended], [4]) == [hf_greedy(phi3_dir, extended, 4)]


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_dynamic_ntk_equals_transformers_cached_generation(tiny_model_dir, impl):
    path = str(tiny_model_dir("llama", **DYNAMIC))
    short, long_ = _prompt(20, 4), _prompt(40, 5)
    want_short, want_long = hf_greedy(path, short, 30), hf_greedy(path, long_, 6)  # 20 + 30 crosses 32
    llm = LLM(path, model_impl=impl, dtype="float32", block_size=4)
    assert engine_greedy(llm, [short], [30]) == [want_short]
    assert engine_greedy(llm, [short, long_], [30, 6]) == [want_short, want_long]
    extended = short + _prompt(20, 6)  # past 32 from the start: a new base for its cached 20-token prefix
    assert engine_greedy(llm, [extended], [4]) == [hf_greedy(path, extended, 4)]
