"""Each FP8 layer of a served FP8 checkpoint on the GPU, alone: its forward (and the fused RMSNorm / SiLU-and-mul
producers) against a dequantized copy of the same layer on the input rounded as the GPU path rounds it, in float32 and
bfloat16, at decode and prefill token counts; and the float model itself on the GPU against transformers on the CPU.
A layer path that is wrong shows here by name (written when a token-by-token comparison with transformers' FP8
emulation failed; that comparison was the fault: e4m3 rounding of activations is discontinuous, see
`test_gpu_fp8.py::test_fp8_checkpoint_error_within_transformers_fp8_error`)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

pytestmark = pytest.mark.gpu

PROMPT = list(range(100, 140))


def _round(x: torch.Tensor) -> torch.Tensor:
    """Per token and 128-wide group, scale = amax / 448, e4m3 (plain torch)."""
    g = x.float().reshape(*x.shape[:-1], -1, 128)
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
    return ((g / scale).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape).to(x.dtype)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-12))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from fxrewrite.runtime.model_files.demo import build_model_dir
    from fxrewrite.runtime.model_files.fp8_checkpoint import write_fp8_checkpoint

    tmp = tmp_path_factory.mktemp("fp8-layers")
    src = build_model_dir(tmp / "bf16", "qwen3", hidden_size=512, num_attention_heads=4, head_dim=128,
                          num_key_value_heads=2, intermediate_size=1024, vocab="qwen3", dtype=torch.bfloat16)
    return src, write_fp8_checkpoint(src, tmp / "fp8")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_fp8_layer_equals_its_dequantized_copy(folders, dtype):
    from fxrewrite.layers.activation import SiluAndMul
    from fxrewrite.layers.fp8_linear import FP8_DTYPE, Fp8LinearMixin, dequantize_fp8_layer
    from fxrewrite.layers.layernorm import RMSNorm
    from fxrewrite.runtime.llm import LLM

    llm = LLM(str(folders[1]), dtype=dtype, gpu_memory_utilization=0.3)
    torch_dtype = getattr(torch, dtype)
    bad, seen = [], 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, layer in llm.llm_engine.model_runner.model.named_modules():
        if not isinstance(layer, Fp8LinearMixin) or layer.weight.dtype != FP8_DTYPE:
            continue
        seen += 1
        plain = copy.deepcopy(layer)
        dequantize_fp8_layer(plain, torch.float32)
        k = layer.weight.shape[1]
        for m in (1, 8, 40):
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch_dtype)
            with torch.no_grad():
                checks = {"forward": (layer(x), x)}
                if name.endswith(("qkv_proj", "gate_up_proj")):
                    norm = RMSNorm(k).cuda().to(torch_dtype)
                    norm.weight.data.normal_(1, 0.2, generator=gen)
                    checks["norm"] = (layer.norm_forward(x, norm)[0], norm(x))
                if name.endswith("down_proj"):
                    x2 = torch.randn(m, 2 * k, device="cuda", generator=gen).to(torch_dtype)
                    checks["silu"] = (layer.silu_forward(x2, SiluAndMul()), SiluAndMul()(x2))
                for what, (got, inp) in checks.items():
                    # the weight-only GEMV (decode counts) reads x unrounded; the GEMMs read it rounded
                    err = min(_rel(got, plain(_round(inp).float())), _rel(got, plain(inp.float())))
                    if err > (1e-2 if dtype == "float32" else 2e-2):
                        bad.append(f"{name} {what} M={m}: relative error {err:.3g}")
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    assert seen and not bad, "\n".join(bad)


def test_float_model_on_the_gpu_equals_transformers(folders):
    """The unquantized source in float32 through the engine on the GPU against transformers on the CPU: whatever
    moves the FP8 comparison that is not FP8 shows here."""
    from transformers import AutoModelForCausalLM

    from fxrewrite.runtime.engine.sampling_params import SamplingParams
    from fxrewrite.runtime.llm import LLM

    llm = LLM(str(folders[0]), dtype="float32", gpu_memory_utilization=0.3)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=0), use_tqdm=False)[0].outputs[0]
    token, ours = out.token_ids[0], out.logprobs[0][out.token_ids[0]].logprob
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(str(folders[0]), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0, -1].log_softmax(-1)
    print(f"float32 first-token logprob: ours {ours:.5f}, transformers {float(ref[token]):.5f}")
    assert token == int(ref.argmax()) and abs(ours - float(ref[token])) < 2e-3
