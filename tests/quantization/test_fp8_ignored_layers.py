"""An FP8 checkpoint that keeps some projections in high precision names them as the checkpoint does (``ignored_layers``
/ ``modules_to_not_convert``: ``layers.1.mlp.gate_proj``, ``up_proj``), though the engine fuses them into one
gate_up_proj: it loads, natively and through the rewrite, and matches transformers on the same folder. Keeping only
some parts of one fused layer is refused with the names (vLLM refuses it too)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.model_files.fp8_checkpoint import write_fp8_checkpoint

KEEP = ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj")
PROMPT = [1, 2, 3, 4, 5, 6, 7]


def _partly_fp8(src, dst, keep, ignored):
    write_fp8_checkpoint(src, dst)
    original, tensors = load_file(str(next(src.glob("*.safetensors")))), load_file(str(dst / "model.safetensors"))
    for name in keep:
        tensors[f"{name}.weight"] = original[f"{name}.weight"]
        tensors.pop(f"{name}.weight_scale_inv")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["ignored_layers"] = list(ignored)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def float_dir(tiny_model_dir):
    return tiny_model_dir("qwen3", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=512, vocab="smollm2")


def test_checkpoint_names_of_fused_parts_keep_them_in_high_precision(float_dir, tmp_path):
    folder = _partly_fp8(float_dir, tmp_path / "partly", KEEP, [k.removeprefix("model.") for k in KEEP])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)  # transformers dequantizes on a CPU
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0, -1].log_softmax(-1)
    for impl in ("native", "transformers"):
        llm = LLM(str(folder), model_impl=impl, dtype="float32", kv_cache_memory_bytes=1 << 22)
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)[0].outputs[0]
        got = {t: lp.logprob for t, lp in out.logprobs[0].items()}
        assert got == pytest.approx({t: float(want[t]) for t in got}, abs=1e-4), impl


def test_keeping_part_of_a_fused_layer_is_refused(float_dir, tmp_path):
    folder = _partly_fp8(float_dir, tmp_path / "half", KEEP[:1], [KEEP[0]])
    with pytest.raises(UserInputError, match=r"keep \['model.layers.1.mlp.gate_proj'\] in high precision but not "
                                              r"\['model.layers.1.mlp.up_proj'\]"):
        LLM(str(folder), model_impl="native", dtype="float32", kv_cache_memory_bytes=1 << 22)


def test_fp8_tensors_of_a_layer_kept_in_high_precision_are_refused(float_dir, tmp_path):
    """ignored_layers names a layer whose tensors the file still holds in e4m3 (with scales): loading its raw e4m3
    values into the high-precision layer, dropping the scales, gave other numbers with only a warning."""
    folder = _partly_fp8(float_dir, tmp_path / "stale", (), [k.removeprefix("model.") for k in KEEP[:2]])
    with pytest.raises(UserInputError, match=r"an FP8 tensor \((F8_E4M3|torch.float8_e4m3fn)\) for a torch.float32 parameter"):
        LLM(str(folder), model_impl="native", dtype="float32", kv_cache_memory_bytes=1 << 22)
