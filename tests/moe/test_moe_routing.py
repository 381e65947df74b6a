"""MoE routing kernels (Triton, through the interpreter) against their torch references: exact equality."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels.moe_routing import (moe_align_block_size, moe_align_block_size_ref, select_experts,
                                           select_experts_ref)


@pytest.fixture
def triton_on(interpret, monkeypatch):
    monkeypatch.setenv("FXREWRITE_TRITON", "1")


@pytest.mark.parametrize("scoring,renormalize,e,k", [("softmax", True, 8, 2), ("softmax", False, 6, 3),
                                                     ("sigmoid", True, 12, 4), ("softmax", True, 5, 1),
                                                     ("softmax", True, 128, 8), ("sigmoid", False, 200, 6)])
def test_select_experts_kernel_equals_reference(triton_on, scoring, renormalize, e, k):
    """Ranks at once up to 128 experts, k rounds of argmax above (200)."""
    logits = torch.randn(9, e, generator=torch.Generator().manual_seed(e + k)) * 3
    got_w, got_ids = select_experts(logits, k, renormalize, scoring)
    want_w, want_ids = select_experts_ref(logits, k, renormalize, scoring)
    assert torch.equal(got_ids, want_ids) and got_ids.dtype == torch.int64
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("t,k,e,block,start", [(1, 8, 128, 16, 0), (7, 2, 6, 4, 0), (70, 4, 12, 16, 0),
                                               (70, 4, 5, 8, 3), (3, 2, 3, 64, 2)])
def test_align_kernel_equals_reference(triton_on, t, k, e, block, start):
    """Several chunks (t*k > 128), experts not a power of two, remote experts dropped (start > 0)."""
    gen = torch.Generator().manual_seed(t * k + e)
    num_global = e + start + 2
    ids = torch.stack([torch.randperm(num_global, generator=gen)[:k] for _ in range(t)])
    got = moe_align_block_size(ids, block, e, start)
    want = moe_align_block_size_ref(ids, block, e, start)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].dtype == got[1].dtype == torch.int64


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 256, 4096])
def test_routing_kernels_on_gpu(t):
    torch.manual_seed(t)
    logits = torch.randn(t, 128, device="cuda")  # float32: bf16 scores tie often, and ties may order either way
    got_w, got_ids = select_experts(logits, 8, True)
    want_w, want_ids = select_experts_ref(logits, 8, True)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    for block in (16, 64):
        got, want = moe_align_block_size(got_ids, block, 128), moe_align_block_size_ref(got_ids, block, 128)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("e", [5, 200])
def test_select_experts_kernel_ties_take_the_lower_index(triton_on, e):
    """Equal scores: the lower expert index first, in both top-k forms (ranks at 5 experts, argmax
    rounds at 200)."""
    logits = torch.full((1, e), -5.0)
    logits[0, [1, 2, 4]] = 3.0
    logits[0, 3] = 2.0
    w, ids = select_experts(logits, 4, False)
    assert ids.tolist() == [[1, 2, 4, 3]]
    assert w[0, 0] == w[0, 1] == w[0, 2] > w[0, 3]
