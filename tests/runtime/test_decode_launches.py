"""Batch-1 decode launches (Triton kernels in the interpreter) and the load-time kernel warm-up.

The native Qwen3 writes K/V from its fused norm-rope kernel: one launch per layer fewer than the unfused
path, no reshape_and_cache launch, no split-KV reduce at one split, and the same greedy tokens as the
torch references; the engine launches the decode attention and that kernel with its static-metadata promise. The
warm-up's dummy steps run through the engine's model and write nothing."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fxrewrite.benchmarks.count_launches import decode_step_launches
from fxrewrite.kernels.paged_decode import _num_splits, decode_warmup_cases
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.models.llama import LlamaAttention
from fxrewrite.runtime.models.qwen3 import Qwen3Attention
from fxrewrite.runtime.worker.warmup import dummy_metadata, warm_up_kernels, warmup_steps


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    """One engine for the file (a tiny 1-layer Qwen3, float32, max_model_len 256)."""
    path = tiny_model_dir("qwen3", num_hidden_layers=1)
    return LLM(str(path), model_impl="native", dtype="float32", kv_cache_memory_bytes=1 << 21, max_model_len=256,
               enable_prefix_caching=False)  # each run computes its own K/V


def test_fused_kv_write_saves_a_launch_per_layer(llm, interpret, monkeypatch):
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    fused = decode_step_launches(llm)
    monkeypatch.setattr(Qwen3Attention, "forward", LlamaAttention.forward)  # norm-rope, then the cache write
    unfused = decode_step_launches(llm)
    assert fused["triton:_qk_norm_rope_cache_kernel"] == 1 and not fused["triton:_reshape_and_cache_kernel"]
    assert unfused["triton:_qk_norm_rope_kernel"] == 1 and unfused["triton:_reshape_and_cache_kernel"] == 1
    assert sum(fused.values()) == sum(unfused.values()) - 1
    assert fused["triton:_decode_kernel"] == 1 and not fused["triton:_reduce_kernel"]  # one split at 256 tokens


def _record_static_metadata(monkeypatch, *targets) -> list:
    """Replace each (module, name) function by one that notes (name, its static_metadata keyword), then calls it."""
    seen = []
    for module, name in targets:
        original = getattr(module, name)

        def call(*args, _original=original, _name=name, **kwargs):
            seen.append((_name, kwargs.get("static_metadata")))
            return _original(*args, **kwargs)
        monkeypatch.setattr(module, name, call)
    return seen


def test_engine_promises_static_metadata(llm, interpret, monkeypatch):
    """The engine's decode attention and the native Qwen3's q/k norm + rope + cache write are launched with
    static_metadata=True (its step metadata is copied in before the forward), so that under PDL they read it before
    waiting on the previous kernel (kernels/pdl.py early_loads); dropping the flag would cost batch-1 speed
    silently (BENCHMARKS.md, thirty-fourth session)."""
    from fxrewrite.kernels import paged_attention as attention_module
    from fxrewrite.runtime.models import qwen3 as qwen3_module

    seen = _record_static_metadata(monkeypatch, (attention_module, "paged_decode_triton"),
                                   (qwen3_module, "qk_norm_rope_cache"))
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    decode_step_launches(llm)
    assert ("paged_decode_triton", True) in seen and ("qk_norm_rope_cache", True) in seen, seen
    assert all(flag for _, flag in seen), seen


def test_after_arm_promises_static_metadata_as_native_does(tiny_model_dir, interpret, monkeypatch):
    """The rewritten Qwen3's q/k norm + rope + cache write reads positions from the rotary module's table, which
    the gather of cos / sin follows: launched with static_metadata=True in every layer of a decode step, as the native
    model's (without it the kernel waits on the qkv GEMV before its first loads: ~0.3 us a layer on an H100)."""
    from fxrewrite.kernels import paged_attention as attention_module
    from fxrewrite.patterns import qk_norm_rope as pattern_module

    path = tiny_model_dir("qwen3", num_hidden_layers=2)
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    after = LLM(str(path), model_impl="transformers", fusion=True, dtype="float32", kv_cache_memory_bytes=1 << 21,
                max_model_len=256)
    seen = _record_static_metadata(monkeypatch, (attention_module, "paged_decode_triton"),
                                   (pattern_module, "qk_norm_rope_cache_triton"))
    decode_step_launches(after)
    assert ("qk_norm_rope_cache_triton", True) in seen and ("paged_decode_triton", True) in seen, seen
    assert all(flag for _, flag in seen), seen


def test_interpreted_kernels_give_the_reference_tokens(llm, interpret, monkeypatch):
    prompts = [list(range(5, 40)), [7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_decode_warmup_cases_reach_every_split_class():
    for heads, max_len in ((8, 2048), (8, 40960), (2, 300), (4, 100)):
        cases = decode_warmup_cases(heads, max_len)
        classes = {max(1, 1 << (_num_splits(n, heads, length) - 1).bit_length()) for n, length in cases}
        wanted = {max(1, 1 << (_num_splits(n, heads, length) - 1).bit_length())
                  for n in (1, 3, 64, 256) for length in range(1, max_len + 1, 97)}
        assert wanted <= classes


def test_dummy_metadata_writes_nothing():
    positions, meta = dummy_metadata(((1, 40), (23, 23)), 16, torch.device("cpu"), [])
    assert positions.tolist() == [39] + list(range(23))
    assert meta.query_start_loc.tolist() == [0, 1, 24] and meta.seq_lens.tolist() == [40, 23]
    assert (meta.slot_mapping == -1).all() and meta.block_tables.shape == (2, 3) and meta.max_query_len == 23


def test_warm_up_runs_the_model_and_leaves_the_cache(llm):
    runner = llm.llm_engine.model_runner
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    built = warm_up_kernels(runner.model, runner.kv_caches, llm.llm_engine.config, llm.llm_engine.model_config,
                            runner.device)
    assert built == []  # nothing compiles on a CPU
    # 4 prefill steps, three decode classes (the merge's BLOCK_S at one split, two, and three or four: partitions
    # of >= 64 keys of a 256-key context)
    assert len(warmup_steps(llm.llm_engine.model_config, 256)) == 7
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches):
        assert torch.equal(k0.nan_to_num(3.0), k1.nan_to_num(3.0)) and torch.equal(v0.nan_to_num(3.0), v1.nan_to_num(3.0))


def _unspecialised(kernel) -> tuple[set, set]:
    """(do_not_specialize, do_not_specialize_on_alignment) names of a jit kernel (compiled or interpreted)."""
    found = getattr(kernel, "kwargs", None) or {a: getattr(kernel, a, None) for a in
                                                 ("do_not_specialize", "do_not_specialize_on_alignment")}
    return set(found.get("do_not_specialize") or ()), set(found.get("do_not_specialize_on_alignment") or ())


def test_serving_kernels_do_not_specialise_on_what_changes_every_step():
    """Each of these arguments changes with the step (block-table width, split count) or points into the
    engine's packed step buffer (prepare_inputs), whose alignment follows the token / sequence counts."""
    from fxrewrite.kernels import paged_decode, paged_prefill, qk_norm_rope, qk_norm_rope_cache, reshape_and_cache, rotary

    wanted = {
        paged_prefill._prefill_kernel: ({"bt_s0"}, {"seq_lens_ptr", "qsl_ptr"}),
        paged_decode._decode_kernel: ({"bt_s0", "num_splits"}, {"seq_lens_ptr", "qsl_ptr"}),
        paged_decode._reduce_kernel: ({"num_splits"}, {"seq_lens_ptr", "qsl_ptr"}),
        qk_norm_rope._qk_norm_rope_kernel: (set(), {"pos_ptr"}),
        qk_norm_rope_cache._qk_norm_rope_cache_kernel: (set(), {"pos_ptr", "slot_ptr"}),
        reshape_and_cache._reshape_and_cache_kernel: (set(), {"slot_ptr"}),
        rotary._rotary_kernel: (set(), {"pos_ptr"}),
    }
    for kernel, (ints, pointers) in wanted.items():
        got_ints, got_pointers = _unspecialised(kernel)
        assert ints <= got_ints and pointers <= got_pointers, kernel


def test_after_arm_gives_transformers_tokens_and_launches_what_native_does(tiny_model_dir, interpret, monkeypatch):
    """The transformers model rewritten, its Triton kernels interpreted: transformers' own greedy tokens (the
    K/V written by the q/k-norm + rotary kernel, read back by later steps and by a prefix-cache hit), and a
    batch-1 decode step launches what the native model's does (K/V written by that kernel, no rotary table
    packed per step or layer) plus two things: each transformers decoder layer ends in its residual add
    (native leaves it to the next layer's norm), and the rotary module gathers the cos/sin every layer is
    handed (native kernels read its table at the positions; so do the fused ones here)."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("qwen3", num_hidden_layers=1)  # launches are counted per layer: one is enough
    prompts, new_tokens = [list(range(5, 30)), [7, 8, 9], list(range(5, 30)) + [4]], 4
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    want = [hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                        attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist() for p in prompts]
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    kwargs = dict(dtype="float32", kv_cache_memory_bytes=1 << 21, max_model_len=256, block_size=4)
    after = LLM(str(path), model_impl="transformers", fusion=True, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in after.generate(prompts[:2], params, use_tqdm=False)]
    got += [o.outputs[0].token_ids for o in after.generate(prompts[2:], params, use_tqdm=False)]
    assert got == want and after.llm_engine.get_stats()["prefix_cache_hits"] > 0  # the last reads the first's K/V
    launches = decode_step_launches(after)
    native = decode_step_launches(LLM(str(path), model_impl="native", **kwargs))
    assert launches["triton:_qk_norm_rope_cache_kernel"] == 1 and not launches["triton:_reshape_and_cache_kernel"]
    assert launches - native == Counter({"aten:add": 1, "aten:index": 1}) and not native - launches, launches


def test_after_arm_moe_folds_its_norm_into_the_router_as_native_does(tiny_model_dir, interpret, monkeypatch):
    """A rewritten Qwen3-MoE's batch-1 decode step: the post-attention residual add + RMSNorm run inside the router
    launch, as in the native model, and the layer's closing residual add in the experts' down kernel, so the after
    arm launches no kernel the native one does not but the rotary gather."""
    path = tiny_model_dir("qwen3_moe", num_hidden_layers=1, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=16)  # transformers' default 128 x 768 experts: minutes interpreted
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    kwargs = dict(dtype="float32", kv_cache_memory_bytes=1 << 21, max_model_len=256, block_size=4)
    after = decode_step_launches(LLM(str(path), model_impl="transformers", fusion=True, **kwargs))
    native = decode_step_launches(LLM(str(path), model_impl="native", **kwargs))
    assert after["triton:_norm_router_kernel"] == native["triton:_norm_router_kernel"] == 1, after  # one a layer
    extra = after - native
    assert extra == Counter({"aten:index": 1}), extra  # the closing residual add is in the experts' down kernel
    assert not native - after, native - after
