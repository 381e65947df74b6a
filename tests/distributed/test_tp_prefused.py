"""Tensor parallelism of projections a model ships fused (Phi-3's ``qkv_proj`` [q | k | v] sliced by its forward,
``gate_up_proj`` chunked in two): TP=2 (gloo ranks) gives transformers' greedy tokens, each rank holding its heads
and half the MLP width (before: refused, "nothing sharded its attention"). Pattern-level proofs and refusals:
tests/patterns/test_prefused.py."""

import pytest

from fxrewrite.benchmarks import arch_sweep

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("kv_heads", [2, 1])  # one kv head per rank; fewer kv heads than ranks (replicated)
def test_phi3_prefused_projections_at_tp2_equal_transformers(tiny_model_dir, kv_heads):
    folder = tiny_model_dir("phi3", num_key_value_heads=kv_heads, initializer_range=0.2)
    ids = arch_sweep.prompts(49152)
    expected = arch_sweep.oracle(folder, ids)
    got = arch_sweep.engine_run(folder, ids, True, {"tensor_parallel_size": 2})
    assert arch_sweep.judge(expected, got)["status"] == "equal", got


def test_each_rank_holds_its_heads_and_half_the_mlp(tiny_model_dir):
    import torch
    from transformers import AutoConfig

    from fxrewrite.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
    from fxrewrite.runtime.models.transformers_backend import TransformersForCausalLM
    from fxrewrite.sharding import shard_model

    folder = tiny_model_dir("phi3", initializer_range=0.2)  # hidden 64, 4 heads of 16, 2 kv heads, MLP 128
    hf = TransformersForCausalLM.from_config(AutoConfig.from_pretrained(folder), torch.float32, True).hf_model
    plan = shard_model(hf, 1, 2)
    attn, mlp = hf.model.layers[0].self_attn, hf.model.layers[0].mlp
    assert {k: plan[f"model.layers.0.{k}"] for k in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                                     "mlp.down_proj")} == {
        "self_attn.qkv_proj": "qkv", "self_attn.o_proj": "rowwise", "mlp.gate_up_proj": "merged",
        "mlp.down_proj": "rowwise"}
    assert isinstance(attn.qkv_proj, QKVParallelLinear) and attn.qkv_output_sizes == [32, 16, 16]
    assert tuple(attn.o_proj.weight.shape) == (64, 32) and attn.num_key_value_heads == 1
    assert isinstance(mlp.gate_up_proj, MergedColumnParallelLinear) and mlp.gate_up_proj.output_sizes_per_partition == [
        64, 64]


def test_phi3_without_fusion_at_tp2_is_refused_naming_the_way_out(tiny_model_dir):
    """Its base_model_tp_plan (colwise_gather_output) splits no head; the refusal says fusion would (a fresh user read
    "no tensor-parallel plan in the model", which Phi-3 has)."""
    from fxrewrite.errors import UnsupportedModelError

    folder = tiny_model_dir("phi3", initializer_range=0.2)
    with pytest.raises(UnsupportedModelError, match=r"Phi3ForCausalLM: layer 0 attends with all 2 key/value heads .* "
                                                    r"run it with fusion on where that proves them"):
        arch_sweep.engine_run(folder, arch_sweep.prompts(49152), False, {"tensor_parallel_size": 2})
