"""Sliding windows, soft-capping, custom scaling, q/k/v bias, multi-head latent attention, attention sinks,
multi-query attention and partial rotary generate exactly (Mistral, Gemma 2, Qwen 2, DeepSeek-V3, GPT-OSS,
GPT-BigCode, GPT-NeoX); models the engine cannot serve exactly are refused at load."""

import json
import shutil

import pytest
import torch

from transformers import CONFIG_MAPPING

from fxrewrite.errors import UnsupportedModelError, UserInputError
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.engine.sampling_params import SamplingParams

# A prompt longer than the window, so the window really cuts keys off.
PROMPTS = ["one two three four five six seven eight nine ten eleven twelve", "Hi"]
MAX_TOKENS = 8

pytestmark = pytest.mark.slow

CASES = {
    "mistral": ({"sliding_window": 4, "initializer_range": 0.2}, [("native", True), ("transformers", False)]),
    "gemma2": (
        {"sliding_window": 4, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
         "query_pre_attn_scalar": 9, "initializer_range": 0.2},
        [("transformers", True), ("transformers", False)],
    ),
    "qwen2": ({"vocab": "smollm2", "initializer_range": 0.2}, [("native", True)]),
    # MLA: keys 24 wide (16 + 8 rotary, interleaved), values 16 wide and padded in the cache; layer 1 is MoE.
    "deepseek_v3": ({}, [("transformers", True), ("transformers", False)]),
    # multi-query attention (one key/value head), a config without num_key_value_heads
    "gpt_bigcode": ({"initializer_range": 0.2}, [("transformers", True), ("transformers", False)]),
    # partial rotary (a quarter of each head), q/k/v fused in one linear
    "gpt_neox": ({"initializer_range": 0.2}, [("transformers", True)]),
    # attention sinks on every layer, a 4-token window on every other one
    "gpt_oss": ({"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4},
                [("transformers", True)]),
}


def hf_greedy(path, recompute: bool = False):
    """transformers' greedy tokens for PROMPTS: `generate`, or with `recompute` the whole sequence's forward for
    every token (RoBERTa decoders: generate passes position ids counted from 0, off the attention mask, while the
    model's own forward numbers positions from padding_idx + 1, as RoBERTa was trained and vLLM serves it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    outs = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        if recompute:
            with torch.no_grad():
                for _ in range(MAX_TOKENS):
                    next_id = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
                    ids = torch.cat([ids, next_id], dim=1)
            outs.append(ids[0, -MAX_TOKENS:].tolist())
            continue
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             do_sample=False, eos_token_id=None)
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


@pytest.mark.parametrize("arch", list(CASES))
def test_arch_greedy_equals_transformers(tiny_model_dir, arch):
    overrides, impls = CASES[arch]
    path = str(tiny_model_dir(arch, **overrides))
    expected = hf_greedy(path)
    for impl, fusion in impls:
        llm = LLM(path, model_impl=impl, fusion=fusion, dtype="float32", block_size=4)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, (impl, fusion)


def test_native_layers_share_one_rotary_cache(tiny_qwen3_dir):
    """One cos/sin cache per model, not one per layer: with Qwen3's yarn override (131072 positions x
    128 dims in float32 = 64 MiB) a per-layer copy costs 28 x 64 MiB. vLLM's get_rope shares it too."""
    from fxrewrite.runtime.model_files.config import ModelConfig
    from fxrewrite.runtime.models.qwen3 import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(ModelConfig.from_pretrained(tiny_qwen3_dir), device="meta")
    ropes = {id(layer.self_attn.rotary_emb) for layer in model.model.layers}
    assert len(model.model.layers) > 1 and len(ropes) == 1
    assert [n for n, _ in model.named_buffers() if n.endswith("cos_sin_cache")] == [
        "model.layers.0.self_attn.rotary_emb.cos_sin_cache"]  # once


@pytest.mark.parametrize("kwargs, named", [({"is_causal": False}, "is_causal=False"),
                                           ({"position_bias": torch.zeros(1)}, "position_bias")])
def test_paged_attention_forward_refuses_semantic_arguments(kwargs, named):
    from fxrewrite.runtime.worker.attention import paged_attention_forward

    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(NotImplementedError, match=named):
        paged_attention_forward(torch.nn.Linear(1, 1), q, q, q, None, **kwargs)


@pytest.mark.parametrize("arch, overrides, kind", [
    ("qwen3_next", {}, "LinearAttentionLayer"), ("granitemoehybrid", {}, "LinearAttentionLayer"),
    ("falcon_h1", {}, "LinearAttentionAndFullAttentionLayer"), ("jamba", {}, "LinearAttentionLayer"),
    ("lfm2", {"full_attn_idxs": [1]}, "conv"), ("llama4_text", {}, "chunked_attention"),
    ("qwen3", {}, None), ("gpt_oss", {}, None), ("gemma2", {}, None), ("deepseek_v3", {}, None),
])
def test_layers_the_paged_cache_cannot_hold_are_refused_at_load(arch, overrides, kind):
    """Mamba / linear-attention / conv layers keep state the paged KV cache does not: refused before any weight
    is read (they used to load and generate different tokens from transformers' from the second step on)."""
    from transformers import AutoConfig

    from fxrewrite.runtime.models.transformers_backend import TransformersForCausalLM, check_attention_only

    config = AutoConfig.for_model(arch, num_hidden_layers=4, **overrides)
    if kind is None:
        check_attention_only(config)
        return
    with pytest.raises(NotImplementedError, match=f"{arch}: layers of kind .*{kind}"):
        TransformersForCausalLM.from_config(config, torch.float32, fusion=True)


def test_only_the_causal_mask_passes_the_load_checks_mask_test():
    """A mask in the call is accepted only where it is the step's plain causal mask (bool, or 0 / very negative):
    the paged kernels build that one themselves. A bidirectional mask or an additive bias (Doge) is not."""
    from fxrewrite.runtime.worker.attention import _is_causal_mask

    allowed = torch.ones(2, 2, dtype=torch.bool).tril()[None, None]
    additive = torch.zeros(1, 1, 2, 2).masked_fill(~allowed, torch.finfo(torch.float32).min)
    assert _is_causal_mask(allowed) and _is_causal_mask(additive)
    assert _is_causal_mask(torch.zeros(1, 4, 2, 2).masked_fill(~allowed, float("-inf")))
    assert not _is_causal_mask(torch.ones(1, 1, 2, 2, dtype=torch.bool))  # bidirectional
    assert not _is_causal_mask(additive + torch.tensor([[0.5, 0.0], [0.0, 0.0]]))  # a bias on an attended score


def test_sinks_follow_this_ranks_heads(monkeypatch):
    """Under tensor parallelism GPT-OSS's module keeps all heads' sinks; rank r attends heads [r*H, (r+1)*H)."""
    from fxrewrite.runtime.worker import attention

    sinks = torch.arange(8.0)
    monkeypatch.setattr(attention, "get_tp_rank", lambda: 1)
    assert torch.equal(attention._sinks({"s_aux": sinks}, 4), torch.tensor([4.0, 5.0, 6.0, 7.0]))
    assert attention._sinks({"s_aux": sinks}, 8) is sinks and attention._sinks({}, 4) is None


@pytest.mark.parametrize("arch, config_json, error, match", [
    # CPM-Ant computes attention in its own code: served, it generated as if every step were the first token
    ("cpmant", {}, UnsupportedModelError, r"CpmAntForCausalLM: the attention of layers \[0, 1\] does not call"),
    # a config.json field the model's code does not read (GPT-NeoX has no num_key_value_heads): the cache would be wrong
    ("gpt_neox", {"num_key_value_heads": 2}, UnsupportedModelError,
     "GPTNeoXForCausalLM: layer 0 attends with 4 key/value heads of width 16, but the config gives 2 of width 16"),
    # BERT without is_decoder: bidirectional, said by the attention module's is_causal, not by the call
    ("bert", {}, UnsupportedModelError, "calls attention with is_causal=False"),
    # ALiBi biases the paged kernels do not add: MPT always, Falcon when its config says so (refused before the build)
    ("mpt", {}, UnsupportedModelError, "mpt: its attention adds ALiBi position biases"),
    ("falcon", {"alibi": True}, UnsupportedModelError, "falcon: its attention adds ALiBi position biases"),
    # GPT-Neo looks its attention class up in a table of its own, which has no entry for the paged attention
    ("gpt_neo", {}, UnsupportedModelError, "gpt_neo: its modeling code picks attention classes from a table"),
    # a layer that attends twice per forward (the second write replaced the first's keys and values; found by
    # benchmarks/arch_sweep.py, served they gave other tokens than transformers): DiffLlama's two value halves,
    # Dory's recurrent loops over one layer
    ("diffllama", {}, UnsupportedModelError, "DiffLlamaAttention calls attention more than once for layer 0"),
    pytest.param("dory", {}, UnsupportedModelError, "DoryAttention calls attention more than once for layer",
                 marks=pytest.mark.skipif("dory" not in CONFIG_MAPPING, reason="this transformers predates Dory")),
    # BART's decoder numbers positions from its own cache and takes no position ids: served, every decoded token sat
    # at position 0 (wrong tokens from the first decode step); with more decoder layers than encoder ones
    # (num_hidden_layers names the encoder's), a layer index past the cache (was an IndexError)
    ("bart", {}, UnsupportedModelError, "BartForCausalLM: the position ids the engine passes do not change its output"),
    ("bart", {"encoder_layers": 1}, UnsupportedModelError,
     r"BartForCausalLM: layer 1 attends, but the config gives 1 layers \(num_hidden_layers\)"),
    # Doge adds a dynamic mask computed from the values, which the paged kernels never read
    ("doge", {}, UnsupportedModelError, r"DogeAttention passes attention a mask of its own \(torch.float32 \[1, 4, 2, 2\]"),
])
def test_models_the_engine_cannot_serve_fail_at_load(tiny_model_dir, tmp_path, arch, config_json, error, match):
    folder = tmp_path / arch
    shutil.copytree(tiny_model_dir(arch), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_json}))
    with pytest.raises(error, match=match) as refused:
        LLM(str(folder), model_impl="transformers")
    # a UserInputError (the CLI prints it as one line) that stays a NotImplementedError, as such refusals always were
    assert isinstance(refused.value, NotImplementedError)


@pytest.mark.skipif("gemma4_unified_text" not in CONFIG_MAPPING, reason="this transformers predates Gemma 4")
def test_layers_of_different_shapes_are_refused_before_the_build(tiny_model_dir):
    """transformers' per_layer_config (Gemma 4: head_dim per layer) has no global shape to size the KV cache by:
    refused naming the attribute (it was transformers' AmbiguousGlobalPerLayerAttributeError from a config check)."""
    with pytest.raises(UnsupportedModelError, match="gemma4_unified_text: its layers differ in head_dim"):
        LLM(str(tiny_model_dir("gemma4_unified_text")), model_impl="transformers")


def test_roberta_decoder_positions_start_after_the_padding_index(tiny_model_dir, monkeypatch):
    """RoBERTa-style embeddings (CamemBERT here) number positions from padding_idx + 1 (transformers'
    create_position_ids_from_input_ids): the engine adds that offset (before: other tokens than transformers from
    the first step), loads the LM head tied to the word embeddings although named_parameters() lists the shared
    tensor as lm_head.decoder.weight (before: "the checkpoint is missing lm_head.decoder.weight"), derives its
    max_model_len from the table less that offset, and refuses one past the table even where a long max_model_len
    is allowed."""
    path = str(tiny_model_dir("camembert", is_decoder=True, max_position_embeddings=64, initializer_range=0.2))
    expected = hf_greedy(path, recompute=True)
    llm = LLM(path, model_impl="transformers", dtype="float32", block_size=4)
    assert llm.llm_engine.model_config.max_model_len == 61  # 64 entries less padding_idx + 1 (pad id 2)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    with pytest.raises(UserInputError, match=r"max_model_len=62 is greater than the derived max_model_len=61 \(from "
                       r"the model config: max_position_embeddings - padding offset 3=61\)"):
        LLM(path, model_impl="transformers", dtype="float32", max_model_len=62)
    monkeypatch.setenv("FXREWRITE_ALLOW_LONG_MAX_MODEL_LEN", "1")  # past the config's limit: the table still holds
    with pytest.raises(UserInputError, match=r"max_model_len=62 is longer than CamembertForCausalLM's "
                       r"position table holds \(61 tokens"):
        LLM(path, model_impl="transformers", dtype="float32", max_model_len=62)


@pytest.mark.skipif("param2moe" not in CONFIG_MAPPING, reason="this transformers predates Param2MoE")
@pytest.mark.parametrize("tp, fusion", [(1, True), (1, False), (2, True)])
def test_checkpoint_split_by_transformers_rules_greedy_equals_transformers(tiny_model_dir, tp, fusion):
    """Param2MoE checkpoints hold one fused query_key_value per layer, which transformers' conversion rules split
    into q / k / v sized by the model's parameters: the engine gives them the stock model's shapes (on meta), as
    the model it loads into may be fused or sharded (before: AttributeError from transformers' Split)."""
    from safetensors import safe_open

    path = str(tiny_model_dir("param2moe", initializer_range=0.2))
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        assert any(name.endswith("query_key_value.weight") for name in f.keys())  # the layout save_pretrained writes
    llm = LLM(path, model_impl="transformers", fusion=fusion, dtype="float32", block_size=4, tensor_parallel_size=tp)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path)


def test_mla_values_wider_than_keys_greedy_equals_transformers(tiny_model_dir):
    """DeepSeek-V3 with v_head_dim (32) above qk_nope + qk_rope (24): the cache is value-wide, queries and keys
    zero-padded to it (before: a shape error on the first request)."""
    path = str(tiny_model_dir("deepseek_v3", v_head_dim=32))
    expected = hf_greedy(path)
    llm = LLM(path, model_impl="transformers", dtype="float32", block_size=4)
    assert llm.llm_engine.model_config.cache_head_dim == 32
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
