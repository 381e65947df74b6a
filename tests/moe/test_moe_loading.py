"""MoE checkpoints load in LLM(...) in every layout transformers loads; greedy tokens equal transformers'.

Folders are written by transformers' own `save_pretrained` (per-expert tensors: ``experts.N.gate_proj``...,
Mixtral's ``block_sparse_moe.experts.N.w1/w2/w3``) and, for the fused 3-D layout
(``experts.gate_up_proj`` / ``experts.down_proj``), by saving the model's state_dict as is.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from tests.distributed.tp_ranks import PROMPTS
from tests.moe.test_moe_parallel import MOE
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM

MAX_TOKENS = 6


def _hf_greedy(path) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.config._experts_implementation = "eager"
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS)
        out.append(gen[0, len(prompt):].tolist())
    return out


def _engine_greedy(path, **kwargs) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 22, block_size=4, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", sorted(MOE))
def test_per_expert_checkpoint_loads_and_matches_transformers(tiny_model_dir, arch):
    path = tiny_model_dir(arch, vocab="smollm2", **MOE[arch])
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert any(".experts.0." in k for k in f.keys())  # the per-expert layout save_pretrained writes
    want = _hf_greedy(path)
    assert _engine_greedy(path, model_impl="transformers") == want
    if arch == "qwen3_moe":
        assert _engine_greedy(path, model_impl="native") == want
        assert _engine_greedy(path, model_impl="transformers", fusion=False) == want


def test_fused_3d_checkpoint_loads(tiny_model_dir, tmp_path):
    src = tiny_model_dir("qwen3_moe", vocab="smollm2", **MOE["qwen3_moe"])
    dst = tmp_path / "fused"
    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    (dst / "model.safetensors").unlink()
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    want = _hf_greedy(src)
    assert _engine_greedy(dst, model_impl="native") == want
    assert _engine_greedy(dst, model_impl="transformers") == want
