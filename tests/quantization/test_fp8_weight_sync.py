"""RL weight sync into an FP8 engine (`llm.load_weights`): float weights are quantized as at load, so syncing the
weights an engine already serves changes nothing, and an FP8 engine never starts serving unrounded weights (it
used to: the float tensors were copied over the CPU's dequantized values, or cast into e4m3 without scales on a
GPU). FP8 tensors the engine would misread are refused before anything is copied."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from fxrewrite.layers.fp8_linear import quantize_fp8_layer, quantize_weight_fp8
from fxrewrite.layers.linear import QKVParallelLinear
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.model_files.fp8_checkpoint import write_fp8_checkpoint
from fxrewrite.runtime.worker.weight_sync import apply_update, plan_update

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 30))]
SAME = 1e-4
"""Log-probabilities of an unchanged engine, run again: equal but for the summation order of a prefill over cached
blocks (the prefix cache holds the first run's prompts unless a sync dropped it); a changed weight moves them far more."""


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
    assert _logprobs(llm) == pytest.approx(before, abs=SAME)  # nothing was copied


def test_float_shards_requantize_an_fp8_layer_as_a_checkpoint_is_quantized():
    """The GPU's layout (e4m3 weight + expanded block scales) checked on the CPU: q/k/v sent as separate float
    tensors, in any order, give each part the bytes and block scales `quantize_weight_fp8` gives that tensor alone
    (an FP8 checkpoint's grid: k and v of 64 rows each get their own block)."""
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
    parts = [quantize_weight_fp8(t, (128, 128)) for t in fresh]
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.weight.view(torch.uint8), torch.cat([q for q, _ in parts]).view(torch.uint8))
    scales = torch.cat([s.repeat_interleave(128, 0)[: t.shape[0]] for (_, s), t in zip(parts, fresh)])
    assert torch.equal(layer.weight_scale_inv, scales)


def test_an_fp8_checkpoints_own_weights_sync_to_the_same_numbers(tiny_model_dir, tmp_path):
    """q / k / v of 64 / 32 / 32 rows share one 128-row block of the fused weight: each part is re-quantized on its
    own, as the checkpoint quantized it, and a part not sent keeps its bytes (fresh user: a shared block moved k/v)."""
    from safetensors.torch import load_file

    fp8_dir = write_fp8_checkpoint(tiny_model_dir("qwen3", vocab="smollm2"), tmp_path / "fp8")
    llm = LLM(str(fp8_dir), model_impl="transformers", dtype="float32", kv_cache_memory_bytes=1 << 22)
    before = _logprobs(llm)
    stored = load_file(str(fp8_dir / "model.safetensors"))
    pairs = [(k, v.float() * stored[k + "_scale_inv"].repeat_interleave(128, 0)[: v.shape[0]].repeat_interleave(
        128, 1)[:, : v.shape[1]] if v.dtype == torch.float8_e4m3fn else v) for k, v in stored.items() if "scale" not in k]
    llm.load_weights(pairs)
    assert _logprobs(llm) == pytest.approx(before, abs=SAME)
    qkv = llm.llm_engine.model_runner.model.hf_model.model.layers[0].self_attn.qkv_proj.weight
    kv_rows = qkv[64:].clone()
    q = dict(pairs)["model.layers.0.self_attn.q_proj.weight"]
    llm.load_weights([("model.layers.0.self_attn.q_proj.weight", q * 1.5)], strict=False)
    assert torch.equal(qkv[64:], kv_rows) and _logprobs(llm) != before


def test_an_fp8_checkpoints_own_weights_sync_to_the_same_numbers_at_tp2(float_dir, tmp_path):
    """Each rank holds half of k_proj's 128-row block: the sync quantizes the whole tensor on the checkpoint's grid,
    then takes the rank's rows, as loading does (quantizing the rank's 64 rows alone moved the output by 0.09)."""
    from safetensors.torch import load_file

    fp8_dir = write_fp8_checkpoint(float_dir, tmp_path / "fp8")
    stored = load_file(str(fp8_dir / "model.safetensors"))
    pairs = [(k, v.float() * stored[k + "_scale_inv"].repeat_interleave(128, 0)[: v.shape[0]].repeat_interleave(
        128, 1)[:, : v.shape[1]] if v.dtype == torch.float8_e4m3fn else v) for k, v in stored.items() if "scale" not in k]
    llm = LLM(str(fp8_dir), model_impl="native", dtype="float32", kv_cache_memory_bytes=1 << 22, tensor_parallel_size=2)
    try:
        before = _logprobs(llm)
        llm.load_weights(pairs)
        assert _logprobs(llm) == pytest.approx(before, abs=SAME)
    finally:
        llm.llm_engine.model_runner.shutdown()


def test_a_bf16_engine_rounds_float32_weights_as_loading_did(float_dir):
    llm = LLM(str(float_dir), model_impl="native", dtype="bfloat16", kv_cache_memory_bytes=1 << 22, quantization="fp8")
    before = _logprobs(llm)
    llm.load_weights(AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32))
    assert _logprobs(llm) == pytest.approx(before, abs=SAME)


def test_meta_tensors_are_refused_before_anything_is_copied(float_dir):
    llm = LLM(str(float_dir), model_impl="native", dtype="float32", kv_cache_memory_bytes=1 << 22)
    before = _logprobs(llm)
    pairs = [(n, t * 2) for n, t in AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).state_dict().items()]
    pairs[-1] = (pairs[-1][0], torch.empty_like(pairs[-1][1], device="meta"))
    with pytest.raises(TypeError, match="is on the meta device; expected a dense tensor"):
        llm.load_weights(pairs)
    for strict in ("yes", None):
        with pytest.raises(TypeError, match=f"strict={strict!r}; expected True or False"):
            llm.load_weights(pairs[:-1], strict=strict)
    assert _logprobs(llm) == pytest.approx(before, abs=SAME)
