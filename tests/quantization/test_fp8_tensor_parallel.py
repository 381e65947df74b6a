"""FP8 under tensor parallelism when a rank's share of a row-parallel input is not a whole number of 128-column
blocks (Qwen3-4B's down_proj at tensor_parallel_size=8: 9728 / 8 = 1216 columns): load-time quantization does
not care (its scales cover the rank's own columns), an FP8 checkpoint's block grid does (refused before any
worker starts, naming the layer and the sizes)."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.runtime.model_files.fp8_checkpoint import write_fp8_checkpoint
from tests.distributed.tp_ranks import MAX_TOKENS, PROMPTS, generate_tokens, make_llm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bf16_dir(tiny_model_dir):
    # intermediate_size 384: 192 columns of down_proj per rank at TP=2, one and a half blocks.
    return tiny_model_dir("qwen3", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=384, vocab="smollm2")


def _per_rank_fp8_reference(path, tp: int):
    """transformers' float model with what quantization='fp8' does on `tp` ranks: one scale per output row of
    each rank's weight, so a row-parallel layer (o_proj, down_proj) has `tp` scales per row, one per column
    share; column-parallel rows are whole on every rank."""
    from transformers import AutoModelForCausalLM

    from fxrewrite.layers.fp8_linear import quantize_weight_fp8_per_channel

    def round_trip(w):
        q, s = quantize_weight_fp8_per_channel(w)
        return q.float() * s[:, None]

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            for proj in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
                proj.weight.copy_(round_trip(proj.weight))
            for proj in (a.o_proj, m.down_proj):
                proj.weight.copy_(torch.cat([round_trip(part) for part in proj.weight.chunk(tp, dim=1)], dim=1))
    return model


def _hf_greedy(model) -> list[list[list[int]]]:
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=None)
        out.append([gen[0, len(prompt):].tolist()])
    return out


def test_quantization_fp8_runs_at_tp2_with_partial_blocks(bf16_dir):
    """fresh-user report: refused by the checkpoint block check (a worker traceback) though no checkpoint
    blocks are involved. Oracle: transformers with the weights each rank quantizes (the random model's
    distributions are flat, so quantizing with TP=1's scales instead gives other tokens)."""
    llm = make_llm(str(bf16_dir), "native", 2, quantization="fp8")
    try:
        got = generate_tokens(llm)
    finally:
        llm.llm_engine.model_runner.shutdown()
    assert got == _hf_greedy(_per_rank_fp8_reference(bf16_dir, 2))


def test_fp8_checkpoint_with_partial_blocks_per_rank_is_refused_before_workers(bf16_dir, tmp_path, monkeypatch):
    import fxrewrite.runtime.engine.llm_engine as llm_engine

    def no_workers(*args, **kwargs):
        raise AssertionError("workers started before the block check")

    monkeypatch.setattr(llm_engine, "create_model_runner", no_workers)
    fp8 = write_fp8_checkpoint(bf16_dir, tmp_path / "fp8")
    with pytest.raises(ValueError, match=r"down_proj: intermediate_size = 384 input columns over tensor_parallel_size"
                                         r"=2 gives 192 per rank, not a multiple of the checkpoint's FP8 block width "
                                         r"128"):
        make_llm(str(fp8), "native", 2)


@pytest.mark.parametrize("arch, sizes, message", [
    ("qwen2_moe", dict(shared_expert_intermediate_size=192),
     r"shared_expert.down_proj: shared_expert_intermediate_size = 192 input columns over tensor_parallel_size=2 "
     r"gives 96 per rank"),
    ("qwen3_moe", dict(mlp_only_layers=[0], intermediate_size=384),  # layer 0 holds a dense MLP
     r"down_proj: intermediate_size = 384 input columns over tensor_parallel_size=2 gives 192 per rank"),
])
def test_moe_checkpoints_row_parallel_mlps_are_checked_before_workers(tiny_model_dir, tmp_path, monkeypatch, arch,
                                                                       sizes, message):
    """fresh-user find: a Qwen2-MoE FP8 checkpoint whose shared expert's down_proj would start mid-block at TP=2 (and a
    Qwen3-MoE one's dense layer) was refused by the workers (a rank's traceback after loading), not before they
    started: the check left every down_proj out for a model with experts."""
    import fxrewrite.runtime.engine.llm_engine as llm_engine

    def no_workers(*args, **kwargs):
        raise AssertionError("workers started before the block check")

    src = tiny_model_dir(arch, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=128, vocab="smollm2", **sizes)
    monkeypatch.setattr(llm_engine, "create_model_runner", no_workers)
    with pytest.raises(ValueError, match=message):
        make_llm(str(write_fp8_checkpoint(src, tmp_path / "fp8")), "transformers", 2)


def test_experts_widths_need_no_fp8_alignment():
    """Mixtral's intermediate_size is its experts' width: FP8 experts are dequantized at load, so no down_proj check."""
    from transformers import MixtralConfig

    from fxrewrite.runtime.model_files.quantization import _row_parallel_inputs

    config = MixtralConfig(hidden_size=256, num_attention_heads=4, intermediate_size=96, num_local_experts=4)
    assert list(_row_parallel_inputs(config)) == ["o_proj"]
