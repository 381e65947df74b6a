"""The native decoder layer through the skinny GEMV (Triton interpreter, FXREWRITE_GEMV=on): its RMSNorms and
SiLU-and-mul run inside the projections (no `rms_norm_kernel` but the final norm, no `_act_and_mul_kernel`,
no cuBLAS GEMM in a batch-1 decode step), and greedy decoding gives the reference tokens."""

from __future__ import annotations

import inspect
from collections import Counter

import pytest

from fxrewrite.benchmarks.count_launches import decode_step_launches
from fxrewrite.kernels import gemv_dispatch
from fxrewrite.layers.skinny import adopt_plain_linears
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM

pytestmark = pytest.mark.slow  # runs first under xdist (tests/conftest.py)


def test_native_decode_fuses_norms_and_activation_into_the_gemv(tiny_model_dir, interpret, monkeypatch):
    path = tiny_model_dir("qwen3", num_hidden_layers=1)
    llm = LLM(str(path), model_impl="native", dtype="float32", kv_cache_memory_bytes=1 << 21, max_model_len=128,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [list(range(5, 20)), [7, 8, 9]]  # a 15-token prefill (cuBLAS) and a 3-token one (the GEMV)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    monkeypatch.setenv("FXREWRITE_GEMV", "on")
    head = llm.llm_engine.model_runner.model.lm_head.weight
    for bucket in (1, 2):  # the 151936-row LM head keeps cuBLAS: too many programs for the interpreter
        gemv_dispatch.record("linear", *head.shape, bucket, None)
    counts = decode_step_launches(llm)
    assert counts["triton:_skinny_gemv_kernel"] == 4  # qkv, o, gate_up, down
    assert counts["triton:rms_norm_kernel"] == 1 and not counts["triton:_act_and_mul_kernel"]
    assert not any(counts[f"aten:{op}"] for op in ("mm", "addmm", "linear", "matmul"))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    gemv_dispatch.clear()
    assert got == want


def test_rewritten_decode_folds_the_norms_and_closing_add(tiny_model_dir, interpret, monkeypatch):
    """The rewritten transformers Qwen3 (after arm): `input_layernorm -> self_attn qkv_proj` runs the input norm in
    qkv_proj's GEMV, `residual add + post_attention_layernorm -> mlp gate_up + residual add` the post-attention norm
    inside gate_up_proj's GEMV and the closing add in down_proj's epilogue, so a batch-1 decode step launches no norm
    but the final one and no torch add, as the native model, and greedy tokens are unchanged."""
    path = tiny_model_dir("qwen3", num_hidden_layers=2)
    llm = LLM(str(path), model_impl="transformers", dtype="float32", kv_cache_memory_bytes=1 << 21,
              max_model_len=128, enable_prefix_caching=False)
    model = llm.llm_engine.model_runner.model
    layer = next(m for m in model.modules() if type(m).__name__ == "Qwen3DecoderLayer")
    names = inspect.unwrap(layer.__dict__["_fxrewrite_compiled"][0]).__code__.co_names
    assert "forward_mlp" in names and "forward_into" in names
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [list(range(5, 20)), [7, 8, 9]]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    monkeypatch.setenv("FXREWRITE_GEMV", "on")
    adopt_plain_linears(model)  # what a GPU load does (prepare_skinny_gemv): o_proj, down_proj dispatch too
    head = next(m for n, m in model.named_modules() if n.endswith("lm_head")).weight
    for bucket in (1, 2):
        gemv_dispatch.record("linear", *head.shape, bucket, None)
    counts = decode_step_launches(llm)
    assert counts["triton:_skinny_gemv_kernel"] == 8  # qkv, o, gate_up (the norm in it), down (the add in it)
    assert counts["triton:rms_norm_kernel"] == 1  # the final norm
    assert not counts["aten:add"] and not any(counts[f"aten:{op}"] for op in ("mm", "addmm", "linear", "matmul"))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    gemv_dispatch.clear()
    assert got == want


def _launches_and_tokens(path, impl: str, monkeypatch, **kwargs) -> tuple[Counter, list]:
    """A batch-1 decode step's launches (Triton interpreted, the GEMV forced on, cuBLAS for the LM head) and greedy
    tokens of two prompts, from an engine of `impl` on `path`."""
    llm = LLM(str(path), model_impl=impl, dtype="float32", kv_cache_memory_bytes=1 << 21, max_model_len=128,
              enable_prefix_caching=False, **kwargs)
    model = llm.llm_engine.model_runner.model
    with monkeypatch.context() as m:
        m.setenv("FXREWRITE_TRITON", "1")
        m.setenv("FXREWRITE_GEMV", "on")
        adopt_plain_linears(model)
        head = next(mod for n, mod in model.named_modules() if n.endswith("lm_head")).weight
        for bucket in (1, 2):
            gemv_dispatch.record("linear", *head.shape, bucket, None)
        counts = decode_step_launches(llm)
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)  # the interpreter: ~1.6 s an FP8 GEMV
        tokens = [o.outputs[0].token_ids for o in llm.generate([list(range(5, 20)), [7, 8, 9]], params,
                                                                use_tqdm=False)]
        gemv_dispatch.clear()
    return counts, tokens


def test_rewritten_fp8_decode_folds_as_the_native_fp8_model(tiny_model_dir, interpret, monkeypatch):
    """The same folds over FP8 weights (`quantization="fp8"`, kept in e4m3 as on the GPU): the input norm in qkv_proj's
    FP8 GEMV, the closing add in down_proj's FP8 GEMV epilogue, so a batch-1 decode step of the rewritten model
    launches what the native FP8 model's does but the rotary gather, and the greedy tokens are the native model's."""
    import fxrewrite.runtime.model_files.quantization as quantization

    monkeypatch.setattr(quantization, "dequantize_fp8_layer", lambda module, dtype: None)  # keep e4m3 on the CPU
    path = tiny_model_dir("qwen3", num_hidden_layers=1)  # the interpreter: ~1.6 s an FP8 GEMV; launches are per layer
    after, after_tokens = _launches_and_tokens(path, "transformers", monkeypatch, quantization="fp8")
    native, native_tokens = _launches_and_tokens(path, "native", monkeypatch, quantization="fp8")
    assert after["triton:_skinny_gemv_fp8_kernel"] == 4 and after["triton:rms_norm_kernel"] == 1, after
    assert after - native == Counter({"aten:index": 1}) and not native - after, (after - native, native - after)
    assert after_tokens == native_tokens


def test_rewritten_llama_decode_launches_the_native_kernels(tiny_model_dir, interpret, monkeypatch):
    """A rewritten Llama (rotary without q/k norms): the rotary kernel writes the rotated q and k into new tensors
    (no copies of the projections' outputs first), so its decode step launches the native model's kernels but the
    rotary gather, with the native model's greedy tokens."""
    path = tiny_model_dir("llama", num_hidden_layers=1)  # launches are per layer
    after, after_tokens = _launches_and_tokens(path, "transformers", monkeypatch)
    native, native_tokens = _launches_and_tokens(path, "native", monkeypatch)
    assert after["triton:_rotary_kernel"] == 1 and not after["aten:clone"], after
    assert after - native == Counter({"aten:index": 1}) and not native - after, (after - native, native - after)
    assert after_tokens == native_tokens
