"""RL weight sync into an FP8 engine (`llm.load_weights`): float weights are quantized as at load, so syncing the
weights an engine already serves changes nothing, and an FP8 engine never starts serving unrounded weights (it
used to: the float tensors were copied over the CPU's dequantized values, or cast into e4m3 without scales on a
GPU). FP8 tensors the engine would misread are refused before anything is copied."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from fxrewrite.layers.fp8_linear import quantize_fp8_layer
from fxrewrite.layers.linear import QKVParallelLinear
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.model_files.fp8_checkpoint import write_fp8_checkpoint
from fxrewrite.runtime.worker.weight_sync import apply_update, plan_update

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 30))]


@pytest.fixture(scope="module")
def float_dir(tiny_model_dir):
    return tiny_model_dir("qwen3", hidden_size=256, num_attention_heads=4, num_key_value_heads=1,
                          intermediate_size=512, vocab="smollm2")


def _logprobs(llm) -> list[float]:
    """The greedy tokens' log-probabilities, both prompts in one list."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [lp[t].logprob for o in outs for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_syncing_the_served_weights_keeps_an_fp8_engine_quantized(float_dir, impl):
    llm = LLM(str(float_dir), model_impl=impl, dtype="float32", kv_cache_memory_bytes=1 << 22, quantization="fp8")
    before = _logprobs(llm)
    plain = _logprobs(LLM(str(float_dir), model_impl=impl, dtype="float32", kv_cache_memory_bytes=1 << 22))
    assert before != pytest.approx(plain, abs=1e-6)  # the FP8 rounding shows in the numbers
    llm.load_weights(AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32))
    assert _logprobs(llm) == pytest.approx(before, abs=1e-5)


def test_fp8_checkpoint_tensors_into_a_dequantized_engine_are_refused(float_dir, tmp_path):
    from safetensors.torch import load_file

    fp8_dir = write_fp8_checkpoint(float_dir, tmp_path / "fp8")
    llm = LLM(str(fp8_dir), model_impl="native", dtype="float32", kv_cache_memory_bytes=1 << 22)
    before = _logprobs(llm)
    pairs = [(k, v) for k, v in load_file(str(fp8_dir / "model.safetensors")).items() if "scale" not in k]
    with pytest.raises(TypeError, match="is torch.float8_e4m3fn, but the engine's parameter .* dequantize it first"):
        llm.load_weights(pairs, strict=False)
    assert _logprobs(llm) == before  # nothing was copied


def test_float_shards_requantize_an_fp8_layer_as_at_load():
    """The GPU's layout (e4m3 weight + expanded block scales) checked on the CPU: q/k/v sent as separate float
    tensors give the bytes and scales `quantize_fp8_layer` gives the fused float weight."""
    torch.manual_seed(0)
    fresh = [torch.randn(n, 256) for n in (256, 64, 64)]
    layer = QKVParallelLinear(256, 64, 4, 1, params_dtype=torch.float32)
    with torch.no_grad():
        layer.weight.copy_(torch.randn_like(layer.weight))
    quantize_fp8_layer(layer, "qkv_proj", (128, 128))
    model = torch.nn.ModuleDict({"attn": torch.nn.ModuleDict({"qkv_proj": layer})})
    model.packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
    names = [f"attn.{part}_proj.weight" for part in "kvq"]  # any order
    plan = plan_update(model, [(name, (64 if part != "q" else 256, 256)) for name, part in zip(names, "kvq")])
    apply_update(plan, [fresh[1], fresh[2], fresh[0]])
    reference = QKVParallelLinear(256, 64, 4, 1, params_dtype=torch.float32)
    with torch.no_grad():
        reference.weight.copy_(torch.cat(fresh))
    quantize_fp8_layer(reference, "qkv_proj", (128, 128))
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.weight.view(torch.uint8), reference.weight.view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv, reference.weight_scale_inv)
