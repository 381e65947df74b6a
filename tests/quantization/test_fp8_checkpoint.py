"""FP8 checkpoints end to end on a CPU: a tiny Qwen3 quantized in 128 x 128 blocks (the Qwen3-*-FP8
layout) served natively and through transformers + fusion gives transformers' own FP8 result
(transformers dequantizes FP8 checkpoints on a CPU; both compute in float32): same greedy tokens, same
log-probabilities. Unsupported quantizations are refused before any weight is read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.model_files.fp8_checkpoint import write_fp8_checkpoint

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40))]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def bf16_dir(tiny_model_dir):
    # head_dim 64 and one kv head: k/v are 64-row partial blocks (fused after q's 256 rows).
    return tiny_model_dir("qwen3", hidden_size=256, num_attention_heads=4, num_key_value_heads=1,
                          intermediate_size=512, vocab="smollm2")


@pytest.fixture(scope="module")
def fp8_dir(bf16_dir, tmp_path_factory):
    return write_fp8_checkpoint(bf16_dir, tmp_path_factory.mktemp("qwen3-fp8"))


def _llm(path, impl, **kwargs):
    from fxrewrite.runtime.llm import LLM

    return LLM(str(path), model_impl=impl, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 22, **kwargs)


def _run(llm):
    """[(tokens, logprob of each token)] per prompt, greedy."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                           o.outputs[0].logprobs)]) for o in outs]


def _greedy(model):
    """[(tokens, logprob of each)] per prompt: greedy decoding with a transformers model (no cache)."""
    return [(tokens, logprobs) for tokens, logprobs, _ in _greedy_with_margins(model)]


def _greedy_with_margins(model):
    """[(tokens, logprob of each, the top-2 logit margin of each step)] per prompt, as `_greedy`."""
    out = []
    for prompt in PROMPTS:
        ids, logprobs, margins = torch.tensor([prompt]), [], []
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                logits = model(ids).logits[0, -1]
                top = logits.topk(2).values
                lp = logits.log_softmax(-1)
                nxt = int(lp.argmax())
                logprobs.append(float(lp[nxt]))
                margins.append(float(top[0] - top[1]))
                ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
        out.append((ids[0, len(prompt):].tolist(), logprobs, margins))
    return out


@pytest.fixture(scope="module")
def hf_fp8_reference(fp8_dir):
    """transformers' FP8 handling: from_pretrained of the FP8 folder (dequantized on a CPU), greedy."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(fp8_dir), dtype=torch.float32).eval()
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32  # dequantized
    return _greedy(model)


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_fp8_checkpoint_matches_transformers_fp8(fp8_dir, hf_fp8_reference, impl):
    llm = _llm(fp8_dir, impl)
    got, want = _run(llm), hf_fp8_reference
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want, strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(want_lps), rtol=1e-4, atol=1e-4)
    linears = [m for m in llm.llm_engine.model_runner.model.modules() if type(m).__name__.startswith("Fp8")]
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers


def _dynamic_fp8_reference(path):
    """The float model with what quantization='fp8' does at TP=1: each fused weight ([q; k; v],
    [gate; up]) and each other projection quantized per output channel (one scale per row), then
    dequantized."""
    from transformers import AutoModelForCausalLM

    from fxrewrite.layers.fp8_linear import quantize_weight_fp8_per_channel

    def round_trip(weights):
        fused = torch.cat([w.weight for w in weights])
        q, s = quantize_weight_fp8_per_channel(fused)
        deq = q.float() * s[:, None]
        for w, part in zip(weights, deq.split([w.weight.shape[0] for w in weights])):
            w.weight.copy_(part)

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            for group in ([a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.gate_proj, m.up_proj], [m.down_proj]):
                round_trip(group)
    return model


def test_quantization_fp8_on_a_float_checkpoint(bf16_dir):
    got, want = _run(_llm(bf16_dir, "native", quantization="fp8")), _greedy(_dynamic_fp8_reference(bf16_dir))
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want, strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(want_lps), rtol=1e-4, atol=1e-4)


def _with_quant_config(src, dst, qc):
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        f.unlink()  # a refusal that read weights would fail on the missing file instead
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes"])
def test_unsupported_quant_method_is_refused_before_weights(bf16_dir, tmp_path, method):
    path = _with_quant_config(bf16_dir, tmp_path / "m", {"quant_method": method, "bits": 4})
    with pytest.raises(ValueError, match=rf"quant_method='{method}'.*supported: \['fp8'\]"):
        _llm(path, "native")


def test_static_activation_scheme_is_refused(bf16_dir, tmp_path):
    path = _with_quant_config(bf16_dir, tmp_path / "m", {"quant_method": "fp8", "activation_scheme": "static",
                                                          "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match="activation_scheme='static' is not supported"):
        _llm(path, "native")


def test_unknown_quantization_argument():
    from fxrewrite.runtime.engine_config import EngineConfig

    with pytest.raises(ValueError, match=r"quantization='awq' is not supported; supported: \['fp8'\]"):
        EngineConfig(quantization="awq")


def test_fp8_checkpoint_tp2_equals_tp1(fp8_dir, tmp_path):
    """Two gloo ranks: q heads split (128 rows each), the 64-row kv head replicated, gate/up, o and down
    sharded with their scales; greedy tokens equal TP=1."""
    import socket

    import torch.multiprocessing as mp

    from tests.distributed.processes import join_or_fail, killed_on_error
    from tests.distributed.tp_ranks import greedy_tokens, spmd_rank

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cases = [(str(fp8_dir), "transformers")]  # HF + fusion + sharding: the longer path (native shards alike)
    out = tmp_path / "tp2.json"
    ctx = mp.start_processes(spmd_rank, args=(port, cases, str(out)), nprocs=2, join=False, start_method="spawn")
    with killed_on_error(ctx):
        expected = {f"{path}|{impl}": greedy_tokens(path, impl) for path, impl in cases}
    join_or_fail(ctx, timeout_s=600, what="TP ranks")
    for rank in (0, 1):  # every rank writes its tokens and its shard's layout (tp_ranks.spmd_rank)
        got = json.loads((tmp_path / f"tp2.json.{rank}").read_text())
        assert {key: case["tokens"] for key, case in got.items()} == expected, rank
        assert all(case["layout"]["tp_size"] == 2 and case["layout"]["tp_rank"] == rank for case in got.values())


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_dummy_weights_of_an_fp8_config_are_fp8_from_the_start(bf16_dir, impl):
    """load_format='dummy' with an FP8 checkpoint's quantization_config (how the benchmarks emulate Qwen3-*-FP8) builds
    the FP8 layers before any weight exists and fills them in e4m3 with scales DUMMY_STD, as a checkpoint would hold
    them, instead of drawing bf16 weights and quantizing them away (which held the whole bf16 model on the GPU first).
    On a CPU the layers are then dequantized: every weight is DUMMY_STD times an e4m3 value, spread ~DUMMY_STD."""
    from fxrewrite.kernels.fp8_gemm import FP8_DTYPE
    from fxrewrite.runtime.model_files.quantization import DUMMY_STD

    overrides = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}}
    llm = _llm(bf16_dir, impl, load_format="dummy", hf_overrides=overrides)
    linears = [m for m in llm.llm_engine.model_runner.model.modules() if type(m).__name__.startswith("Fp8")]
    assert len(linears) == 4 * 2  # qkv, o, gate_up, down in each of the 2 layers
    for layer in linears:
        units = layer.weight.detach().float() / DUMMY_STD
        torch.testing.assert_close(units, units.to(FP8_DTYPE).float(), rtol=1e-6, atol=0)  # on the e4m3 grid
        assert 0.8 < float(units.std()) < 1.2
    tokens, _ = _run(llm)[0]
    assert len(tokens) == MAX_TOKENS


def _round_activations_fp8(module, args):
    """A linear's input as the GPU path quantizes it (`activation_scheme: "dynamic"`): per token and 128-wide group,
    scale = amax / 448, e4m3; written here in plain torch."""
    x = args[0]
    g = x.reshape(*x.shape[:-1], -1, 128)
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
    return ((g / scale).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape)


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_e4m3_layers_kept_on_the_cpu_compute_what_the_gpu_path_should(fp8_dir, impl, monkeypatch):
    """The GPU's arithmetic through the kernels' torch references: e4m3 weights and scales kept (not dequantized, as
    CPUs otherwise do), activations quantized per 1 x 128 group, block-scaled products. It must equal transformers'
    dequantized model with each linear's input rounded the same way (float32): a loader or layout fault that the
    dequantized CPU path hides shows here."""
    from transformers import AutoModelForCausalLM

    import fxrewrite.runtime.model_files.quantization as quantization

    monkeypatch.setattr(quantization, "dequantize_fp8_layer", lambda layer, dtype: None)
    llm = _llm(fp8_dir, impl)
    assert any(p.dtype == torch.float8_e4m3fn for p in llm.llm_engine.model_runner.model.parameters())
    hf = AutoModelForCausalLM.from_pretrained(str(fp8_dir), dtype=torch.float32).eval()
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.register_forward_pre_hook(_round_activations_fp8)
    for (tokens, lps), oracle in zip(_run(llm), _greedy_with_margins(hf), strict=True):
        _assert_greedy_within_rounding(tokens, lps, *oracle)


FLIP_TIE = 0.25
"""Logit margin between the oracle's two best tokens below which the engine may take the other one, and (FLIP_LOGPROB)
how far a chosen token's log-prob may move. Both paths round each linear's input to e4m3 (steps 1/8 apart) from
float32 values whose last bits differ (fused vs separate projections, block-scaled vs dequantized products, the CPU's
GEMM blocking): an input that close to a rounding boundary lands on the neighbouring value in one path only. On an Intel
Xeon (AMX; the first two tokens equal to 2e-6) such flips moved a log-prob by 0.044, then took a token whose oracle
margin was 0.104 with a log-prob 0.14 above the oracle's; a loader or layout fault moves log-probs by whole units from
the first token."""
FLIP_LOGPROB = 0.2


def _assert_greedy_within_rounding(tokens, lps, want_tokens, want_lps, margins):
    """The engine's greedy tokens and their log-probs are the oracle's, within `FLIP_TIE` / `FLIP_LOGPROB`, up to the
    first step where it takes the oracle's near-tied runner-up (the continuations part there)."""
    for step, (token, want) in enumerate(zip(tokens, want_tokens, strict=True)):
        if token != want:
            assert margins[step] < FLIP_TIE, f"step {step}: engine {token}, oracle {want} (margin {margins[step]:.3f})"
            # the engine's token is the oracle's runner-up, whose log-prob is the best one's less the margin
            assert abs(lps[step] - (want_lps[step] - margins[step])) <= FLIP_LOGPROB, (step, lps, want_lps, margins)
            return
        assert abs(lps[step] - want_lps[step]) <= FLIP_LOGPROB, (step, lps, want_lps)
