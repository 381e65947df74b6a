"""Batch-invariant mode end to end: the engine's sampled-token logprobs (chunked prefill, decode steps,
batches of different sizes) equal, bit for bit, the trainer's recomputation of the same tokens with
gradients (`completion_logprobs` on the optimized model inside `batch_invariant_mode()`), because both run
the same kernels: every Triton kernel through the interpreter here (FXREWRITE_TRITON=1), float32."""

import pytest
import torch

import fxrewrite
from fxrewrite.kernels.batch_invariant import batch_invariant_mode, log_softmax_batch_invariant
from fxrewrite.kernels.paged_attention import causal_attention_batch_invariant
from fxrewrite.rl import completion_logprobs
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM

pytestmark = pytest.mark.slow  # runs first under xdist (tests/conftest.py)

PROMPTS = [list(range(5, 18)), [30, 31, 32], [40, 41, 42, 43, 44]]


def _rowwise_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter's tl.dot with each output element summed over k in one order. numpy's BLAS matmul
    (the interpreter's own dot) gives a row other low bits at another row index of the same tile, where a
    GPU's MMA computes every element alike; the kernels' batch invariance relies on the GPU's behaviour."""
    from triton.runtime.interpreter import TensorHandle

    dtype = d.data.dtype
    prod = a.data.astype(dtype)[:, :, None] * b.data.astype(dtype)[None, :, :]
    return TensorHandle(prod.sum(axis=1, dtype=dtype) + d.data, d.dtype.scalar)


@pytest.fixture
def triton_kernels(monkeypatch):
    from triton.runtime.interpreter import InterpreterBuilder

    monkeypatch.setenv("FXREWRITE_TRITON", "1")  # the Triton kernels, in the interpreter, on both sides
    monkeypatch.setattr(InterpreterBuilder, "create_dot", _rowwise_dot)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_engine_and_trainer_logprobs_bitwise_equal(tiny_model_dir, triton_kernels, arch):
    """qwen3_moe: the MoE block's router and experts take the reference path in the mode on both sides (the
    engine's decode router / direct experts kernels and a trainer's grouped GEMMs round differently)."""
    from transformers import AutoModelForCausalLM

    small_moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32} if arch == "qwen3_moe" else {}
    path = str(tiny_model_dir(arch, vocab="smollm2", num_hidden_layers=1, **small_moe))  # not 128 experts of 768
    trainer = fxrewrite.optimize(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)).train()
    for p in trainer.parameters():  # own (aligned) storage: CPU BLAS rounds by the operands' alignment too,
        p.data = p.data.clone()    # and safetensors' mmap leaves some at 8-byte offsets
    llm = LLM(path, model_impl="transformers", dtype="float32", block_size=4, max_num_batched_tokens=8,
              kv_cache_memory_bytes=1 << 20, batch_invariant=True)  # chunked prefill: 8 tokens a step
    llm.load_weights(trainer)
    params = [SamplingParams(temperature=1.0, seed=s, logprobs=0, max_tokens=m, ignore_eos=True)
              for s, m in ((1, 4), (2, 2), (3, 3))]
    samples = [(list(o.prompt_token_ids), list(c.token_ids), [s[t].logprob for t, s in zip(c.token_ids, c.logprobs)])
               for o in llm.generate(PROMPTS, params, use_tqdm=False) for c in o.outputs]
    with batch_invariant_mode():
        mine = completion_logprobs(trainer, [p for p, _, _ in samples], [c for _, c, _ in samples],
                                   micro_batch_size=2)  # rows padded to other lengths than the engine's
    assert trainer.config._attn_implementation != "fxrewrite_batch_invariant"  # restored
    assert mine[0].requires_grad  # the training kernels ran (their backward: the attention test below)
    assert len(samples) == len(mine) == len(PROMPTS)
    for (_, _, engine), recomputed in zip(samples, mine, strict=True):
        assert torch.tensor(engine).tolist() == recomputed.detach().tolist()


def test_causal_attention_batch_invariant_matches_math_and_has_gradients(triton_kernels):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 9, 16, generator=g, requires_grad=True) for _ in range(2))
    with batch_invariant_mode():
        out = causal_attention_batch_invariant(q, k, v, 0.25)
        one_row = causal_attention_batch_invariant(q[1:, :, :5], k[1:, :, :5], v[1:, :, :5], 0.25)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25,
                                                                enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(one_row[0], out[1, :5])  # a row's queries do not see the other rows or later keys
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    expected.sum().backward()
    for got, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, t.grad, rtol=1e-4, atol=1e-5)


def test_log_softmax_batch_invariant_rows_and_gradient(triton_kernels):
    x = torch.randn(5, 2100, requires_grad=True)
    out = log_softmax_batch_invariant(x)
    torch.testing.assert_close(out, torch.log_softmax(x, -1), rtol=1e-5, atol=1e-5)
    assert torch.equal(log_softmax_batch_invariant(x[2:3])[0], out[2])
    with batch_invariant_mode():
        routed = torch.log_softmax(x, dim=-1)
    assert torch.equal(routed, out)
    routed[:, 0].sum().backward()
    expected = torch.autograd.grad(torch.log_softmax(x, -1)[:, 0].sum(), x)[0]
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-6)


def test_batch_invariant_moe_decodes_without_graphs(tiny_model_dir, monkeypatch):
    """The MoE reference path (data-dependent shapes) cannot be held in a CUDA graph: batch-invariant MoE engines
    decode eagerly (graphs emulated on the CPU); dense ones keep their graphs."""
    from fxrewrite.runtime.worker.cuda_graphs import EMULATE_ENV

    monkeypatch.setenv(EMULATE_ENV, "1")
    runners = {}
    for arch in ("qwen3", "qwen3_moe"):
        llm = LLM(str(tiny_model_dir(arch, vocab="smollm2", num_hidden_layers=1)), model_impl="transformers",
                  dtype="float32", kv_cache_memory_bytes=1 << 20, max_num_seqs=4, batch_invariant=True)
        runners[arch] = llm.llm_engine.model_runner.graph_runner
    assert runners["qwen3"] is not None and runners["qwen3_moe"] is None
