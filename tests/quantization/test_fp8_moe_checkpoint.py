"""FP8 mixture-of-experts checkpoints (the Qwen3-30B-A3B-FP8 layout: every expert projection e4m3 with
128 x 128 block scales, the router in high precision) on a CPU: served natively and through transformers +
fusion, they give transformers' own FP8 result (transformers dequantizes FP8 checkpoints on a CPU; all in
float32): same greedy tokens, log-probabilities within 1e-4."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.layers.fp8_linear import quantize_weight_fp8
from fxrewrite.runtime.model_files.fp8_checkpoint import write_fp8_checkpoint
from fxrewrite.runtime.model_files.fp8_experts import dequantize_fp8_experts
from tests.quantization.test_fp8_checkpoint import _greedy, _llm, _run

MOE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=256, norm_topk_prob=True, vocab="smollm2")


@pytest.fixture(scope="module")
def fp8_moe_dir(tiny_model_dir, tmp_path_factory):
    return write_fp8_checkpoint(tiny_model_dir("qwen3_moe", **MOE), tmp_path_factory.mktemp("qwen3-moe-fp8"))


@pytest.fixture(scope="module")
def hf_reference(fp8_moe_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(fp8_moe_dir), dtype=torch.float32).eval()
    model.config._experts_implementation = "eager"
    assert model.model.layers[0].mlp.experts.down_proj.dtype == torch.float32  # dequantized
    return _greedy(model)


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_fp8_moe_checkpoint_matches_transformers_fp8(fp8_moe_dir, hf_reference, impl):
    llm = _llm(fp8_moe_dir, impl)
    for (tokens, lps), (want_tokens, want_lps) in zip(_run(llm), hf_reference, strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(want_lps), rtol=1e-4, atol=1e-4)
    names = [n for n, m in llm.llm_engine.model_runner.model.named_modules() if type(m).__name__.startswith("Fp8")]
    assert names and not any(n.endswith(".gate") for n in names)  # attention in FP8, routers not


def test_expert_weights_dequantize_in_any_order_and_a_lone_half_is_an_error():
    w = torch.randn(200, 130)
    q, scale = quantize_weight_fp8(w, (128, 128))
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    for order in ([(name, q), (name + "_scale_inv", scale)], [(name + "_scale_inv", scale), (name, q)]):
        out = dict(dequantize_fp8_experts([("other", w)] + order, (128, 128)))
        assert set(out) == {"other", name}
        torch.testing.assert_close(out[name], q.float() * scale.repeat_interleave(128, 0)[:200].repeat_interleave(
            128, 1)[:, :130])
        torch.testing.assert_close(out[name], w, rtol=0.07, atol=1e-3)  # e4m3 keeps ~3 mantissa bits
    from fxrewrite.errors import UserInputError  # one line in the CLI, not a traceback

    with pytest.raises(UserInputError, match="experts.3.up_proj.weight_scale_inv.*no partner"):
        list(dequantize_fp8_experts([(name + "_scale_inv", scale)], (128, 128)))
    with pytest.raises(UserInputError, match=r"experts.3.up_proj.weight: FP8 scales of shape \(2, 2\) do not match"):
        list(dequantize_fp8_experts([(name, q), (name + "_scale_inv", scale)], (64, 128)))


def test_fp8_checkpoint_refuses_bad_folders_before_writing(tmp_path, fp8_moe_dir, tiny_model_dir):
    from fxrewrite.errors import UserInputError

    with pytest.raises(UserInputError, match="must be a model folder with config.json"):
        write_fp8_checkpoint(tmp_path / "nope", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserInputError, match="already quantized"):
        write_fp8_checkpoint(fp8_moe_dir, tmp_path / "again")
    with pytest.raises(UserInputError, match="is SRC"):
        write_fp8_checkpoint(fp8_moe_dir, fp8_moe_dir)
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "model.safetensors.index.json").write_text("{}")  # an old sharded copy: its index would win
    with pytest.raises(UserInputError, match=r"already holds a model's files \(model.safetensors.index.json\)"):
        write_fp8_checkpoint(fp8_moe_dir, stale)
    (stale / "model.safetensors.index.json").unlink()
    (stale / "pytorch_model.bin").write_bytes(b"")  # another model's weights are not overwritten or left beside
    with pytest.raises(UserInputError, match=r"already holds a model's files \(pytorch_model.bin\)"):
        write_fp8_checkpoint(fp8_moe_dir, stale)
    (stale / "pytorch_model.bin").unlink()
    (stale / "config.json").write_text("{}")
    with pytest.raises(UserInputError, match=r"already holds a model's files \(config.json\)"):
        write_fp8_checkpoint(fp8_moe_dir, stale)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UserInputError, match="cannot make DST .*a-file/sub"):
        write_fp8_checkpoint(tiny_model_dir("qwen3"), tmp_path / "a-file" / "sub")


def test_bench_config_that_is_not_json_is_one_clear_error(tmp_path):
    from fxrewrite.benchmarks.common import load_bench_config
    from fxrewrite.errors import UserInputError

    bad = tmp_path / "README.md"
    bad.write_text("# not json")
    with pytest.raises(UserInputError, match="is not a JSON bench config"):
        load_bench_config(bad)
