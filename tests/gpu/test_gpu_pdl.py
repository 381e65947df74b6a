"""Programmatic Dependent Launch on the GPU (sm90+): the decode kernels launched with PDL inside a captured CUDA
graph give bitwise the outputs of the same graph captured without it, for the whole per-layer chain at
Qwen3-4B shapes (skinny GEMVs with and without split-K, q/k norm + rotary + cache write, paged decode with its
merge, SiLU-and-mul + cuBLAS between PDL kernels), and a long chain of dependent GEMVs; the split-K GEMV
matches the unfused reference. CPU tests: tests/kernels/test_pdl.py."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.benchmarks.common import load_bench_config
from fxrewrite.benchmarks.decode_chain import build, layer
from fxrewrite.benchmarks.gemv import projections
from fxrewrite.kernels import gemv_tune
from fxrewrite.kernels.pdl import device_supports_pdl, pdl_enabled
from fxrewrite.kernels.skinny_gemv import SPLIT_CONFIGS, configs_for, skinny_gemv_triton

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper():
    if not device_supports_pdl("cuda"):
        pytest.fail("these tests need a CUDA device with compute capability >= 9.0 (PDL)")


def _replay(fn, monkeypatch, pdl: str):
    """fn()'s outputs from a CUDA graph captured with FXREWRITE_PDL=pdl (after one eager warm-up call)."""
    monkeypatch.setenv("FXREWRITE_PDL", pdl)
    assert pdl_enabled("cuda") == (pdl == "on")
    return _captured(fn)


def _captured(fn):
    """fn()'s outputs from a CUDA graph of it, replayed twice after one eager warm-up call."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    graph.replay()
    graph.replay()  # a second replay: the split-K counters must have been reset by the first
    torch.cuda.synchronize()
    return [o.clone() for o in outs]


@pytest.mark.parametrize("down", ["split", "unsplit", "cublas"])
def test_layer_chain_with_pdl_equals_without(monkeypatch, down):
    cfg = load_bench_config("qwen3-4b")["config"]
    model = build(cfg, layers=3, context=300, max_model_len=4096)  # 300 keys: the split + merge path
    split_cfg = SPLIT_CONFIGS[1][0]
    choice = {"qkv_proj": configs_for(1)[1], "o_proj": split_cfg, "gate_up_proj": configs_for(1)[0],
              "down_proj": {"split": split_cfg, "unsplit": configs_for(1)[0], "cublas": None}[down]}
    snapshot = [(lw["kc"].clone(), lw["vc"].clone()) for lw in model["layers"]]

    def step():
        hidden, residual = model["hidden"], model["residual"]
        for lw in model["layers"]:
            hidden, residual = layer(model, lw, hidden, residual, choice)
        return [hidden, residual] + [c for lw in model["layers"] for c in (lw["kc"], lw["vc"])]

    def restore():
        for lw, (kc, vc) in zip(model["layers"], snapshot):
            lw["kc"].copy_(kc)
            lw["vc"].copy_(vc)

    off = _replay(step, monkeypatch, "off")
    restore()
    on = _replay(step, monkeypatch, "on")
    for i, (a, b) in enumerate(zip(on, off)):
        assert torch.equal(a, b), f"output {i} differs with PDL"
    assert off[0].isfinite().all() and off[0].abs().max() > 0


def test_dependent_gemv_chain_with_pdl_equals_without(monkeypatch):
    """40 GEMVs, each reading the previous one's output (o_proj shape, split-K and not, alternating)."""
    n = k = 2560
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(4)]
    x0 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    configs = (configs_for(1)[0], SPLIT_CONFIGS[1][1])

    def chain():
        x = x0
        for i in range(40):
            x = skinny_gemv_triton(x, ws[i % 4], config=configs[i % 2])
            x = x / x.abs().amax().clamp_min(1e-6)  # a plain torch kernel between two PDL launches
        return [x]

    assert torch.equal(_replay(chain, monkeypatch, "on")[0], _replay(chain, monkeypatch, "off")[0])


@pytest.mark.parametrize("proj", ["o_proj", "down_proj"])
@pytest.mark.parametrize("m", [1, 2])
def test_split_k_configs_at_qwen3_4b_shapes(monkeypatch, proj, m):
    monkeypatch.setenv("FXREWRITE_PDL", "on")
    kind, n, k = projections(load_bench_config("qwen3-4b")["config"])[proj]
    w = gemv_tune.scratch_weights(n, k, "cuda", torch.bfloat16)[0]
    args = gemv_tune.make_inputs(kind, m, k, "cuda", torch.bfloat16, seed=m)
    want = gemv_tune.baseline(kind, w, **args)
    assert len(configs_for(m, kind, n)) > len(configs_for(m))  # split-K candidates at this narrow N
    for config in configs_for(m, kind, n):
        first = gemv_tune.candidate(kind, w, config=config, **args)
        assert gemv_tune.max_rel_error(first, want) < 2e-2, f"config {config}"
        assert torch.equal(gemv_tune.candidate(kind, w, config=config, **args), first)  # deterministic


def test_pipelined_gemv_chain_with_pdl_equals_without(monkeypatch):
    """40 pipelined one-token GEMVs (they prefetch weight lines to L2 before the wait), each reading the previous
    one's output, alternating Qwen3-4B's gate_up and down shapes, a torch kernel between them."""
    from fxrewrite.kernels.skinny_gemv_pipelined import PIPELINED_CONFIGS, skinny_gemv_pipelined_triton

    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for n, k in ((9728, 2560), (2560, 9728))]
    x0 = torch.randn(1, 2560, device="cuda", dtype=torch.bfloat16)

    def chain():
        x = x0
        for i in range(40):
            x = skinny_gemv_pipelined_triton(x, ws[i % 2], config=PIPELINED_CONFIGS[i % len(PIPELINED_CONFIGS)])
            x = x / x.abs().amax().clamp_min(1e-6)
        return [x]

    assert torch.equal(_replay(chain, monkeypatch, "on")[0], _replay(chain, monkeypatch, "off")[0])


def test_fp8_pipelined_gemv_chain_with_pdl_equals_without(monkeypatch):
    """The FP8 pipelined GEMV (per-channel and block scales) in a chain of 40, as the bf16 one above."""
    from fxrewrite.kernels.fp8_gemv_pipelined import PIPELINED_CONFIGS, fp8_gemv_pipelined_triton

    shapes = ((9728, 2560), (2560, 9728))
    ws = [(torch.randn(n, k, device="cuda") * 0.5).to(torch.float8_e4m3fn) for n, k in shapes]
    scales = [torch.rand(n, -(-k // 128), device="cuda") / k ** 0.5 + 1e-3 for n, k in shapes]
    x0 = torch.randn(1, 2560, device="cuda", dtype=torch.bfloat16)

    def chain():
        x = x0
        for i in range(40):
            x = fp8_gemv_pipelined_triton(x, ws[i % 2], scales[i % 2], PIPELINED_CONFIGS[i % len(PIPELINED_CONFIGS)],
                                          per_channel=i % 4 < 2)
            x = x / x.abs().amax().clamp_min(1e-6)
        return [x]

    assert torch.equal(_replay(chain, monkeypatch, "on")[0], _replay(chain, monkeypatch, "off")[0])


def test_fp8_gemv_triggering_its_dependents_equals_without(monkeypatch):
    """FXREWRITE_PDL_FP8_GEMV=trigger: the plainly launched FP8 GEMV lets the next PDL kernel (the residual
    RMSNorm that reads its output) launch during its last wave; 40 GEMVs alternating Qwen3-32B's o_proj and
    qkv shapes with block scales, bitwise the chain without PDL."""
    from fxrewrite.kernels import pdl
    from fxrewrite.kernels.fp8_gemv_pipelined import PIPELINED_CONFIGS, fp8_gemv_pipelined_triton
    from fxrewrite.kernels.rms_norm import rms_norm

    shapes = ((5120, 8192), (8192, 5120))
    ws = [(torch.randn(n, k, device="cuda") * 0.5).to(torch.float8_e4m3fn) for n, k in shapes]
    scales = [torch.rand(n, -(-k // 128), device="cuda") / k ** 0.5 + 1e-3 for n, k in shapes]
    norm_w = torch.rand(5120, device="cuda", dtype=torch.bfloat16) + 0.5
    x0, r0 = (torch.randn(1, n, device="cuda", dtype=torch.bfloat16) for n in (8192, 5120))

    def chain():
        x, residual = x0, r0.clone()
        for i in range(40):
            x = fp8_gemv_pipelined_triton(x, ws[i % 2], scales[i % 2], PIPELINED_CONFIGS[i % len(PIPELINED_CONFIGS)],
                                          per_channel=False)
            if i % 2 == 0:  # [1, 5120]: the norm reads the GEMV's output ([1, 8192] feeds the next o_proj)
                x, residual = rms_norm(x, norm_w, 1e-6, residual)
        return [x, residual]

    monkeypatch.setenv("FXREWRITE_PDL_FP8_GEMV", "trigger")
    monkeypatch.setattr(pdl, "_ENABLED", {})
    assert pdl.fp8_gemv_pdl("cuda") == (False, True)
    want = _replay(chain, monkeypatch, "off")
    monkeypatch.setenv("FXREWRITE_PDL", "auto")
    for got, expected in zip(_captured(chain), want):
        assert torch.equal(got, expected)


# 2 layers of the real layer shapes (benchmarks/configs/qwen3-30b-a3b.json, qwen3-4b.json), Qwen3's vocabulary
_SHAPES = {
    "qwen3_moe": dict(hidden_size=2048, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4,
                      head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                      num_experts_per_tok=8, norm_topk_prob=True, vocab="qwen3"),
    "qwen3": dict(hidden_size=2560, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  intermediate_size=9728, vocab="qwen3"),
}


@pytest.mark.parametrize("arch, quantization", [("qwen3", None), ("qwen3_moe", None), ("qwen3", "fp8")])
def test_engine_decode_with_pdl_equals_without(tmp_path, monkeypatch, arch, quantization):
    """One bf16 engine (its kernels tuned once), eager: greedy tokens and log-probs bitwise the same with every
    decode kernel launched with PDL (router, direct experts, pipelined GEMVs, attention; with FP8 weights the
    RMSNorm / SiLU-and-mul kernels that quantize and the per-token quantization) as without. Prefix caching
    off: with it the second generate would reuse the first one's prompt blocks and prefill only the suffix, which
    changes the numerics whatever PDL does."""
    from fxrewrite.runtime.engine.sampling_params import SamplingParams
    from fxrewrite.runtime.llm import LLM
    from fxrewrite.runtime.model_files.demo import build_model_dir

    path = build_model_dir(tmp_path / arch, arch, **_SHAPES[arch])
    llm = LLM(str(path), dtype="bfloat16", enforce_eager=True, max_model_len=1024, kv_cache_memory_bytes=256 << 20,
              enable_prefix_caching=False, quantization=quantization)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = [list(range(100, 400)), [7, 8, 9]]

    def run(pdl: str):
        monkeypatch.setenv("FXREWRITE_PDL", pdl)
        assert pdl_enabled(torch.device("cuda", torch.cuda.current_device())) == (pdl == "on")
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()}
                                                for step in o.outputs[0].logprobs]) for o in outs]

    off = run("off")
    assert run("on") == off
    assert run("off") == off
