"""Weight sync and sleep mode through `LLM(tensor_parallel_size=2)`'s driver + 2 CPU worker processes:
each rank takes its slice of the synced tensors; a bad update changes nothing; sleep/wake keeps tokens."""

import pytest
import torch

from tests.distributed.tp_ranks import generate_tokens, make_llm

import fxrewrite

SMALL_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}  # not 128 of 768


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_tp2_load_weights_sleep_and_wake_up(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    old = str(tiny_model_dir("qwen3", num_key_value_heads=1, vocab="smollm2"))
    new = str(tiny_model_dir("qwen3", num_key_value_heads=1, vocab="smollm2", seed=1))
    source = fxrewrite.optimize(AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32))
    reference = generate_tokens(make_llm(new, "transformers"))
    llm = make_llm(old, "transformers", tensor_parallel_size=2)
    try:
        before = generate_tokens(llm)
        pairs = list(source.named_parameters())
        i = next(i for i, (n, _) in enumerate(pairs) if n.endswith("mlp.gate_up_proj.weight"))
        bad = pairs[:i] + [(pairs[i][0], pairs[i][1][:, :-1])] + pairs[i + 1:]
        with pytest.raises(ValueError, match="gate_up_proj.weight.*has shape"):
            llm.load_weights(bad)
        assert generate_tokens(llm) == before
        llm.load_weights(source)
        assert generate_tokens(llm) == reference != before
        llm.sleep(level=1)
        assert llm.llm_engine.is_sleeping()
        llm.wake_up()
        assert generate_tokens(llm) == reference
        llm.sleep(level=2)
        llm.wake_up()
        with pytest.raises(RuntimeError, match="load_weights"):
            generate_tokens(llm)
        llm.load_weights(AutoModelForCausalLM.from_pretrained(old, dtype=torch.float32))  # HF names
        assert generate_tokens(llm) == before
    finally:
        llm.llm_engine.model_runner.shutdown()


@pytest.mark.parametrize("impl, expert_parallel", [("transformers", False), ("transformers", True),
                                                   ("native", True)])
def test_tp2_moe_load_weights_takes_each_ranks_experts(tiny_model_dir, impl, expert_parallel):
    """A fused MoE's 3-D experts ([E, 2I, H] / [E, H, I], transformers 5's layout) sync at tensor_parallel_size=2:
    each rank takes its columns (tensor parallel) or its experts (expert parallel), as the loader does (fresh user:
    every MoE sync at TP=2 was refused, the full tensor compared with the rank's shape); a wrong shape names only
    the shape (it was also reported as a missing tensor)."""
    from transformers import AutoModelForCausalLM

    old, new = (str(tiny_model_dir("qwen3_moe", vocab="smollm2", seed=s, **SMALL_MOE)) for s in (0, 1))
    reference = generate_tokens(make_llm(new, impl))
    llm = make_llm(old, impl, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    try:
        before = generate_tokens(llm)
        source = fxrewrite.optimize(AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32))
        pairs = list(source.named_parameters())
        i = next(i for i, (n, _) in enumerate(pairs) if n.endswith("experts.down_proj"))
        with pytest.raises(ValueError, match="experts.down_proj.*has shape") as bad:
            llm.load_weights(pairs[:i] + [(pairs[i][0], pairs[i][1][:-1])] + pairs[i + 1:])
        assert "no tensor for" not in str(bad.value)
        assert generate_tokens(llm) == before
        llm.load_weights(source)
        assert generate_tokens(llm) == reference != before
        llm.load_weights(AutoModelForCausalLM.from_pretrained(old, dtype=torch.float32))  # stock, HF names
        assert generate_tokens(llm) == before
    finally:
        llm.llm_engine.model_runner.shutdown()
