"""SiLU/GELU-and-mul: reference vs the HF gated MLP formula; kernel vs reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fxrewrite.kernels import activation as mod
from fxrewrite.kernels.activation import gelu_and_mul, gelu_and_mul_ref, silu_and_mul, silu_and_mul_ref


def test_refs_match_hf_gated_mlp():
    gate, up = torch.randn(3, 2, 20), torch.randn(3, 2, 20)
    x = torch.cat([gate, up], dim=-1)
    # (not bit-equal: torch's vectorised silu may round a strided slice differently by 1 ulp)
    torch.testing.assert_close(silu_and_mul_ref(x), F.silu(gate) * up)
    torch.testing.assert_close(gelu_and_mul_ref(x, "tanh"), F.gelu(gate, approximate="tanh") * up)
    torch.testing.assert_close(gelu_and_mul_ref(x), F.gelu(gate) * up)


def test_refs_reject_bad_input():
    with pytest.raises(ValueError, match="must be even"):
        silu_and_mul_ref(torch.randn(2, 7))
    with pytest.raises(ValueError, match="approximate"):
        gelu_and_mul(torch.randn(2, 8), approximate="fast")


@pytest.mark.parametrize("act", [0, 1, 2])
def test_kernel_matches_ref(interpret, act):
    x = torch.randn(5, 2 * 40) * 3
    want = {0: silu_and_mul_ref(x), 1: gelu_and_mul_ref(x), 2: gelu_and_mul_ref(x, "tanh")}[act]
    torch.testing.assert_close(mod._act_and_mul_triton(x, act), want, rtol=1e-5, atol=1e-5)


def test_public_functions_dispatch_when_forced(interpret, monkeypatch):
    calls = []
    original = mod._act_and_mul_triton

    def spy(x, act, **kw):
        calls.append(act)
        return original(x, act, **kw)

    monkeypatch.setattr(mod, "_act_and_mul_triton", spy)
    x = torch.randn(2, 3, 32)
    silu_and_mul(x)
    gelu_and_mul(x, "tanh")
    assert not calls  # not forced, CPU tensor: the reference path
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gelu_and_mul(x), gelu_and_mul_ref(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gelu_and_mul(x, "tanh"), gelu_and_mul_ref(x, "tanh"), rtol=1e-5, atol=1e-5)
    assert calls == [0, 1, 2]  # each public function ran the kernel, with its own activation code


@pytest.mark.gpu
@pytest.mark.parametrize("fn,ref", [(silu_and_mul, silu_and_mul_ref), (gelu_and_mul, gelu_and_mul_ref)])
def test_kernel_matches_ref_gpu(cuda, fn, ref):
    x = torch.randn(4096, 2 * 11008, device=cuda, dtype=torch.bfloat16)
    torch.testing.assert_close(fn(x), ref(x), rtol=2e-2, atol=2e-2)
