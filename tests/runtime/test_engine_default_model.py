"""The built-in default model (SmolLM2-135M-Instruct, real weights) through the engine."""

import pytest
import torch

from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hf_reference(default_model_dir):
    """(prompt ids, transformers' greedy continuation in float32) of the chat prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    input_ids = ids["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    gen = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_TOKENS,
                         do_sample=False)
    return input_ids[0].tolist(), gen[0, input_ids.shape[1]:].tolist()


def test_default_llm_chat_answers_paris(default_model_dir):
    llm = LLM()
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("impl, fusion", [("native", True), ("transformers", True), ("transformers", False)])
def test_default_model_greedy_equals_transformers(default_model_dir, hf_reference, impl, fusion):
    prompt_ids, expected = hf_reference
    llm = LLM(model_impl=impl, fusion=fusion, dtype="float32")
    assert llm.llm_engine.model_runner.model.impl == impl
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == expected
    assert "Paris" in out.outputs[0].text


def test_make_run_prints_the_answer_and_tokens_per_second(default_model_dir, capsys):
    """`make run` = `python -m fxrewrite.runtime.model_files.demo run` with its defaults (issue 4's last must-show)."""
    import re

    from fxrewrite.runtime.model_files.demo import main

    assert main(["run", "--max-tokens", "16"]) == 0
    out = capsys.readouterr().out
    answer = next(line for line in out.splitlines() if line.startswith("assistant:"))
    assert "Paris" in answer
    assert re.search(r"^\d+ tokens in [\d.]+ s, prefill included: [\d.]+ tokens/s$", out, re.MULTILINE), out
