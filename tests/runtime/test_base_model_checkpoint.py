"""A base model's checkpoint (saved from ``Qwen3Model``: no ``model.`` prefix, no head, as embedding models such as
Qwen3-Embedding ship) loads as transformers' from_pretrained loads it (the prefix added): the pooling runner embeds
with it (the head is never read), a tied model generates with it, an untied one is refused naming the head; a BERT
encoder's is refused for its bidirectional attention, not for 40 missing tensors. The oracle is transformers."""

import json
import shutil

import pytest
import torch

from fxrewrite.errors import UnsupportedModelError, UserInputError
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM

ENGINE = {"dtype": "float32", "kv_cache_memory_bytes": 4 << 20, "max_model_len": 64}


def _base_folder(model_dir, out, architectures=None):
    """`model_dir`'s decoder saved alone (its base model), with its tokenizer; `architectures` written over the
    config's ("Qwen3Model" as saved)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.model.save_pretrained(out)
    for file in model_dir.iterdir():
        if "token" in file.name or file.name in ("vocab.json", "merges.txt"):
            shutil.copy(file, out / file.name)
    if architectures is not None:
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "architectures": architectures}))
    return out


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_pooling_embeds_from_a_base_models_checkpoint(tiny_model_dir, tmp_path, impl):
    from transformers import AutoModel

    folder = _base_folder(tiny_model_dir("qwen3", tie_word_embeddings=False), tmp_path / "base",
                          ["Qwen3ForCausalLM"])  # as Qwen3-Embedding's config says
    llm = LLM(str(folder), model_impl=impl, runner="pooling", **ENGINE)
    ids = llm.get_tokenizer().encode("The capital of France is")
    got = torch.tensor(llm.embed([ids], use_tqdm=False)[0].outputs.embedding)
    with torch.no_grad():
        hidden = AutoModel.from_pretrained(str(folder), dtype=torch.float32)(torch.tensor([ids])).last_hidden_state
    torch.testing.assert_close(got, torch.nn.functional.normalize(hidden[0, -1], dim=-1), rtol=1e-5, atol=1e-5)
    with pytest.raises(UserInputError, match=r"missing 1 parameter\(s\): lm_head.weight \(a base model's checkpoint"):
        LLM(str(folder), model_impl=impl, **ENGINE)  # generating needs the head it lacks


def test_a_tied_base_checkpoint_generates_as_transformers_loads_it(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = _base_folder(tiny_model_dir("qwen3", tie_word_embeddings=True), tmp_path / "tied", ["Qwen3ForCausalLM"])
    llm = LLM(str(folder), model_impl="transformers", **ENGINE)
    ids = llm.get_tokenizer().encode("Once upon a time")
    got = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    stock = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    want = stock.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(ids):]
    assert list(got[0].outputs[0].token_ids) == want.tolist()


def test_a_bert_encoders_checkpoint_is_refused_for_its_attention(tiny_qwen3_dir, tmp_path):
    from transformers import BertConfig, BertModel

    out = tmp_path / "bert"
    config = BertConfig(vocab_size=151936, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    BertModel(config).save_pretrained(out)
    for file in tiny_qwen3_dir.iterdir():
        if "token" in file.name or file.name in ("vocab.json", "merges.txt"):
            shutil.copy(file, out / file.name)
    with pytest.raises(UnsupportedModelError, match=r"is_causal=False \(bidirectional attention\)"):
        LLM(str(out), runner="pooling", **ENGINE)


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_a_head_saved_beside_the_base_model_keeps_its_name(tiny_model_dir, tmp_path, impl):
    """``lm_head.weight`` beside unprefixed base-model tensors is the model's own name: transformers loads it as it
    is (it prefixes only the keys the model names with the prefix), so an untied model generates as transformers'."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    folder = _base_folder(tiny_model_dir("qwen3", tie_word_embeddings=False), tmp_path / "head", ["Qwen3ForCausalLM"])
    stock = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir("qwen3", tie_word_embeddings=False)),
                                                 dtype=torch.float32)
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, "lm_head.weight": stock.lm_head.weight.detach().clone()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    llm = LLM(str(folder), model_impl=impl, **ENGINE)
    ids = llm.get_tokenizer().encode("Once upon a time")
    got = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    want = stock.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(ids):]
    assert list(got[0].outputs[0].token_ids) == want.tolist()


def test_a_vlms_legacy_names_are_left_to_transformers_renamings():
    """A Gemma 3 VLM checkpoint in its legacy layout (language_model.model.*, vision_tower.*: no key starts with
    "model.") is not a base model's: transformers' renamings give it the prefix, so none is added (before the
    renamings were taken into account, multi_modal_projector.* named a module once prefixed and every key got it)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, Gemma3Config

    from fxrewrite.runtime.model_files.base_model import missing_prefix
    from fxrewrite.runtime.model_files.checkpoint_conversion import renamed_keys

    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, vocab_size=300)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(Gemma3Config(text_config=text, vision_config=vision))
    keys = ["language_model.model.layers.0.self_attn.q_proj.weight", "language_model.model.embed_tokens.weight",
            "vision_tower.vision_model.embeddings.patch_embedding.weight",
            "multi_modal_projector.mm_input_projection_weight"]
    wrapper = type("Wrapper", (), {"hf_model": model})()
    assert missing_prefix(model, keys) == "model."  # what the names alone suggest
    assert missing_prefix(model, renamed_keys(wrapper, keys, native=False)) is None
