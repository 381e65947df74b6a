"""`LLM(hf_overrides=...)` end to end: the overridden config reaches the model and generates exactly
like transformers built from the same overridden config (issue 4's user story, DESIGN.md's data path)."""

import json

import pytest
import torch

from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # runs first under xdist (tests/conftest.py)

PROMPTS = ["Hello, my name is", "The capital of France is a city where many people live and"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# A flat key (applied at load), a nested rope dict (replaces the old one whole) and max_model_len.
YARN = {
    "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                        "rope_theta": 1e6},
    "max_model_len": 1024,
}


def hf_greedy(path, overrides):
    """transformers' greedy tokens, its model built from ModelConfig's overridden hf_config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fxrewrite.runtime.model_files.config import ModelConfig

    config = ModelConfig.from_pretrained(path, hf_overrides=overrides).hf_config
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)
    assert model.model.rotary_emb.rope_type == "yarn"
    tok = AutoTokenizer.from_pretrained(path)
    outs = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             eos_token_id=None)
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


@pytest.mark.parametrize("impl, fusion", [("native", True), ("transformers", True)])
def test_yarn_overrides_generate_like_transformers(tiny_qwen3_dir, impl, fusion):
    llm = LLM(str(tiny_qwen3_dir), model_impl=impl, fusion=fusion, dtype="float32", block_size=4,
              hf_overrides=YARN)
    model_config = llm.llm_engine.model_config
    assert model_config.max_model_len == 1024 and model_config.rope_parameters["rope_type"] == "yarn"
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_qwen3_dir, YARN)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_callable_and_json_overrides_are_accepted(tiny_qwen3_dir):
    """hf_overrides may be a dict, its JSON text, or a callable(config) -> config (issue 2, item 3)."""

    def shrink(config):
        config.max_position_embeddings = 300
        return config

    llm = LLM(str(tiny_qwen3_dir), model_impl="native", dtype="float32", hf_overrides=shrink)
    assert llm.llm_engine.model_config.max_model_len == 300
    llm = LLM(str(tiny_qwen3_dir), model_impl="native", dtype="float32", hf_overrides=json.dumps(YARN))
    assert llm.llm_engine.model_config.max_model_len == 1024
    with pytest.raises(TypeError, match="hf_overrides.*int"):
        LLM(str(tiny_qwen3_dir), hf_overrides=42)
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        LLM(str(tiny_qwen3_dir), hf_overrides="{oops")


def test_fewer_layers_by_override_load_like_transformers(tiny_qwen3_dir, caplog):
    """fresh-8 F18: num_hidden_layers=1 on a 2-layer checkpoint was a ValueError on the native model (the
    transformers implementation, and transformers itself, load it): the extra layer is skipped, and said so."""
    overrides = {"num_hidden_layers": 1}
    with caplog.at_level("WARNING", logger="fxrewrite.runtime.model_files.loader"):
        native = LLM(str(tiny_qwen3_dir), model_impl="native", dtype="float32", hf_overrides=overrides)
    assert "decoder layers [1] are not loaded" in caplog.text
    hf = LLM(str(tiny_qwen3_dir), model_impl="transformers", dtype="float32", hf_overrides=overrides)
    tokens = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] for llm in (native, hf)]
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("overrides", [
    {"hidden_act": "gelu"},
    {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
])
def test_auto_serves_what_the_native_llama_would_compute_differently_with_transformers(tiny_llama_dir, overrides):
    """A Llama config the native class computes otherwise than transformers' LlamaForCausalLM: a non-SiLU
    hidden_act (it was refused under model_impl='auto', the default) and a partial_rotary_factor (transformers'
    Llama rotates the whole head and ignores it; the native model rotated half: other greedy tokens, silently).
    'auto' now picks the transformers backend for them, and tokens equal transformers'; 'native' says why not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fxrewrite.errors import UserInputError
    from fxrewrite.runtime.model_files.config import ModelConfig

    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64, hf_overrides=overrides)
    assert llm.llm_engine.model_runner.model.impl == "transformers"
    config = ModelConfig.from_pretrained(tiny_llama_dir, hf_overrides=overrides).hf_config
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, config=config, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(tiny_llama_dir)(PROMPTS[1], return_tensors="pt").input_ids
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              eos_token_id=None)[0, ids.shape[1]:].tolist()
    assert llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    with pytest.raises(UserInputError, match=r"model_impl='native': the native LlamaForCausalLM does not compute "
                                             r"this config as transformers does: (hidden_act|partial_rotary_factor)"):
        LLM(str(tiny_llama_dir), model_impl="native", dtype="float32", max_model_len=64, hf_overrides=overrides)
