"""torch.func.grad and vmap(grad) through an optimized model on a GPU, against stock transformers (float32 and
bf16): the fused layers take their torch references while a functorch transform runs. Prints the largest relative
gradient difference per dtype; exits 1 when one is over the dtype's tolerance.
Usage (GPU machine): python -m fxrewrite.benchmarks.torch_func_check"""

from __future__ import annotations

import copy
import sys

import torch
from torch.func import functional_call, grad, vmap
from transformers import AutoModelForCausalLM, Qwen3Config

from fxrewrite.benchmarks.tool_cli import require_cuda
from fxrewrite.compiler import optimize
from fxrewrite.weights import to_hf_names


def _worst(want: dict, got: dict) -> float:
    return max(((got[k].float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-12)).item()
               for k, w in want.items())


def check(dtype: torch.dtype) -> tuple[float, float]:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    stock = AutoModelForCausalLM.from_config(cfg).to("cuda", dtype).train()
    fused = optimize(copy.deepcopy(stock)).train()
    ids = torch.randint(0, 512, (2, 32), device="cuda")

    def loss(model):
        return lambda p, x: functional_call(model, p, (), {"input_ids": x, "labels": x}).loss

    def params(model):
        return {n: p.detach() for n, p in model.named_parameters()}

    whole = _worst(grad(loss(stock))(params(stock), ids), to_hf_names(fused, grad(loss(fused))(params(fused), ids)))
    one = lambda m: (lambda p, x: loss(m)(p, x[None]))  # noqa: E731
    want = vmap(grad(one(stock)), in_dims=(None, 0))(params(stock), ids)
    per = vmap(grad(one(fused)), in_dims=(None, 0))(params(fused), ids)
    sample = max(_worst({k: v[i] for k, v in want.items()}, to_hf_names(fused, {k: v[i] for k, v in per.items()}))
                 for i in range(ids.shape[0]))
    return whole, sample


def main() -> int:
    require_cuda("torch_func_check")
    bad = False
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        whole, sample = check(dtype)
        print(f"{dtype}: grad max rel diff {whole:.2e}, per-sample {sample:.2e} (tolerance {tol:g})")
        bad |= max(whole, sample) > tol
    return int(bad)


if __name__ == "__main__":
    sys.exit(main())
