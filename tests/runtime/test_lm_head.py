"""The transformers backend's logits equal the `*ForCausalLM`'s own, whatever its head does after lm_head: a
scaling the config names and the engine applies itself (Granite divides, Gemma 2 soft-caps), or one it does not
know (HyperCLOVAX multiplies by `logits_scaling`), which is then computed by the model's own forward."""

import pytest
import torch

from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM

PROMPT = "one two three four five six"


@pytest.mark.parametrize("arch, overrides, by_model_code", [
    ("hyperclovax", {"logits_scaling": 0.25}, True),
    ("granite", {"logits_scaling": 4.0}, False),
    ("gemma2", {"final_logit_softcapping": 3.0}, False),
    ("qwen3", {}, False),
    ("opt", {}, False),  # its head code calls self.model.decoder: checked, not skipped with a warning
])
def test_logprobs_equal_the_model_heads(tiny_model_dir, arch, overrides, by_model_code, caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tiny_model_dir(arch, initializer_range=0.2, **overrides))
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt").input_ids
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        expected = torch.log_softmax(hf(ids).logits[0, -1].float(), -1)

    llm = LLM(path, model_impl="transformers", dtype="float32")
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
    top = out.outputs[0].logprobs[0]
    assert set(top) == set(expected.topk(5).indices.tolist())
    for token, lp in top.items():
        assert lp.logprob == pytest.approx(expected[token].item(), rel=1e-4, abs=1e-4), token
    assert llm.llm_engine.model_runner.model.head_by_model_code is by_model_code
    assert "could not be checked" not in caplog.text


def test_model_code_head_restores_the_decoder_stack(tiny_qwen3_dir):
    from fxrewrite.runtime.models.transformers_backend import same_logits

    llm = LLM(str(tiny_qwen3_dir), model_impl="transformers", dtype="float32")
    model = llm.llm_engine.model_runner.model
    stack = model.hf_model.model
    hidden = torch.randn(3, model.config.hidden_size)
    assert same_logits(model.logits_by_model_code(hidden), model.logits_from_config(hidden))
    assert model.hf_model.model is stack
    assert not same_logits(model.logits_from_config(hidden), model.logits_from_config(hidden) * 1.01)


def test_a_head_that_projects_first_runs_the_model_code():
    """RemBERT's head maps the hidden states (64) to its output embedding width (32) before the vocabulary: its
    output embeddings cannot take the hidden states, so the first call runs the model's own head code (before: a
    shape error that failed the load check)."""
    from transformers import AutoModelForCausalLM, RemBertConfig

    from fxrewrite.runtime.models.transformers_backend import TransformersForCausalLM

    config = RemBertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                           intermediate_size=64, input_embedding_size=32, output_embedding_size=32, is_decoder=True)
    hf = AutoModelForCausalLM.from_config(config).eval()
    model = TransformersForCausalLM(hf)
    hidden = torch.randn(3, 64)
    with torch.no_grad():
        expected = hf.cls(hidden)
        assert torch.equal(model.compute_logits(hidden), expected) and model.head_by_model_code
        assert torch.equal(model.compute_logits(hidden), expected)
