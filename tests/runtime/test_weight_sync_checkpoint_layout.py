"""`LLM.load_weights` with a checkpoint's per-expert names (``mlp.experts.3.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.3.w1.weight``), as read from the safetensors files of a hub folder: each layer's experts
are stacked by transformers' conversion rules; a layer with missing experts is refused before anything is copied."""

import pytest
import torch

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.model_files.checkpoint_conversion import checkpoint_layout_to_model
from fxrewrite.runtime.model_files.loader import iterate_safetensors

MOE = {"qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
       "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
       "deepseek_v3": {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}}
PROMPTS = ["Hello, my name is", "1 2 3 4 5 6 7 8 9 10 11 12"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _params(llm):
    return {n: p.detach().clone() for n, p in llm.llm_engine.model_runner.model.named_parameters()}


@pytest.mark.parametrize("arch, impl", [("qwen3_moe", "native"), ("qwen3_moe", "transformers"),
                                        ("mixtral", "transformers"), ("deepseek_v3", "transformers")])
def test_checkpoint_files_of_another_folder_give_its_tokens(tiny_model_dir, arch, impl):
    old, new = (tiny_model_dir(arch, vocab="smollm2", seed=s, **MOE[arch]) for s in (0, 1))
    pairs = list(iterate_safetensors(new))
    assert any(".experts.0." in n for n, _ in pairs)  # the per-expert layout save_pretrained writes
    llm = LLM(str(old), model_impl=impl, dtype="float32", block_size=4)
    before = _tokens(llm)
    llm.load_weights(pairs)
    expected = _tokens(LLM(str(new), model_impl=impl, dtype="float32", block_size=4))
    assert _tokens(llm) == expected != before


def test_a_persistent_buffer_is_copied_when_sent_and_not_asked_for(tiny_model_dir):
    """DeepSeek-V3's router bias `e_score_correction_bias` is a persistent buffer (in the checkpoint, not among a
    trainer's parameters): a checkpoint's value lands in the engine and moves its routing; parameters alone still
    pass strict=True. (It matched no parameter, so a hub checkpoint could not be synced at all.)"""
    folder = tiny_model_dir("deepseek_v3", vocab="smollm2", **MOE["deepseek_v3"])
    pairs = list(iterate_safetensors(folder))
    llm = LLM(str(folder), model_impl="transformers", dtype="float32", block_size=4)
    before = _tokens(llm)
    biased = [(n, torch.linspace(-4, 4, t.numel()).reshape(t.shape) if n.endswith("e_score_correction_bias") else t)
              for n, t in pairs]
    llm.load_weights(biased)
    engine = dict(llm.llm_engine.model_runner.model.named_buffers())
    sent = {n: t for n, t in biased if n.endswith("e_score_correction_bias")}
    assert sent and all(torch.equal(engine["hf_model." + n], t) for n, t in sent.items())
    assert _tokens(llm) != before
    llm.load_weights([(n, t) for n, t in pairs if n not in sent])  # strict: the buffer is not required
    assert all(torch.equal(engine["hf_model." + n], t) for n, t in sent.items())  # and kept


def test_missing_expert_is_refused_and_nothing_changes(tiny_model_dir):
    old, new = (tiny_model_dir("qwen3_moe", vocab="smollm2", seed=s, **MOE["qwen3_moe"]) for s in (0, 1))
    pairs = [(n, t) for n, t in iterate_safetensors(new) if ".layers.1.mlp.experts.5.up_proj." not in n]
    llm = LLM(str(old), model_impl="native", dtype="float32", block_size=4)
    before = _params(llm)
    with pytest.raises(UserInputError, match=r"'model.layers.1.mlp.experts.gate_up_proj' is missing expert\(s\) \[5\] "
                                             r"of 'mlp.experts.\*.up_proj.weight'.*also with strict=False"):
        llm.load_weights(pairs, strict=False)
    after = _params(llm)
    assert all(torch.equal(before[n], after[n]) for n in before)


def _renumbered(pairs, old, new):
    return [(n.replace(f".experts.{old}.", f".experts.{new}."), t) for n, t in pairs]


@pytest.mark.parametrize("change, message", [
    (lambda p: _renumbered(p, 7, 99), r"tensor 'model.layers.0.mlp.experts.99.\w+.weight': expert index 99 is out of "
                                      r"range for num_experts=8 \(expected 0 .. 7\)"),
    (lambda p: p + [p[2]], r"tensors '(.*)' and '\1' are both expert 0 of 'model.layers.0.mlp.experts.\w+'"),
    (lambda p: [(n, t[:, :-1] if n.endswith("experts.3.gate_proj.weight") and ".layers.0." in n else t) for n, t in p],
     r"tensor 'model.layers.0.mlp.experts.3.gate_proj.weight' has shape \(32, 63\), expert tensor '.*' \(32, 64\)"),
    # every gate_proj short, up_proj not: torch.cat's RuntimeError before (a fresh user's find)
    (lambda p: [(n, t[:, :-1] if n.endswith("gate_proj.weight") else t) for n, t in p],
     r"tensor 'model.layers.0.mlp.experts.0.(gate|up)_proj.weight' has shape \(32, 6[34]\), tensor "
     r"'model.layers.0.mlp.experts.0.(gate|up)_proj.weight' \(32, 6[34]\); expected one shape for the projections "
     r"stacked into 'model.layers.0.mlp.experts.gate_up_proj'"),
])
def test_bad_expert_sets_are_refused_naming_the_tensor(change, message):
    """Per-expert tensors are checked by index and shape before any is stacked (a renumbered expert 7 was stacked
    into slot 7; a short one raised torch.stack's RuntimeError)."""
    gen = torch.Generator().manual_seed(0)
    pairs = [(f"model.layers.0.mlp.experts.{e}.{part}.weight",
              torch.randn((64, 32) if part == "down_proj" else (32, 64), generator=gen))
             for e in range(8) for part in ("down_proj", "gate_proj", "up_proj")]
    with pytest.raises(UserInputError, match=message):
        checkpoint_layout_to_model(change(pairs), "qwen3_moe", 8)


def test_model_names_pass_unchanged():
    pairs = [("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(2, 4, 3)),
             ("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(6, 3))]
    assert checkpoint_layout_to_model(pairs, "qwen3_moe", 2) is pairs
    assert checkpoint_layout_to_model(pairs, "llama", None) is pairs


def test_stacked_in_expert_order_whatever_the_order_given():
    gate = [(f"model.layers.0.mlp.experts.{e}.gate_proj.weight", torch.full((2, 3), float(e))) for e in range(3)]
    up = [(f"model.layers.0.mlp.experts.{e}.up_proj.weight", torch.full((2, 3), 10.0 + e)) for e in range(3)]
    out = dict(checkpoint_layout_to_model(list(reversed(gate)) + up, "qwen3_moe", 3))
    fused = out["model.layers.0.mlp.experts.gate_up_proj"]
    assert fused.shape == (3, 4, 3)
    assert fused[:, 0, 0].tolist() == [0.0, 1.0, 2.0] and fused[:, 2, 0].tolist() == [10.0, 11.0, 12.0]
