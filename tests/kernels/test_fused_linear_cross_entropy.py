"""Cross-entropy gradient kernel and chunked linear cross-entropy vs autograd through full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fxrewrite.kernels.cross_entropy import cross_entropy_grad_, cross_entropy_grad_ref
from fxrewrite.kernels.fused_linear_cross_entropy import (default_chunk_size, fused_linear_cross_entropy,
                                                          fused_linear_cross_entropy_ref)


@pytest.mark.parametrize("scale,softcap", [(1.0, None), (0.25, None), (1.0, 3.0), (2.0, 5.0)])
def test_cross_entropy_kernel_matches_ref(interpret, scale, softcap):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 150, generator=gen) * 4
    target = torch.randint(0, 150, (6,), generator=gen)
    target[2] = -100
    want_loss, want_grad = cross_entropy_grad_ref(logits, target, -100, scale, softcap)
    z = logits.clone()
    loss = cross_entropy_grad_(z, target, -100, scale, softcap)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(z, want_grad, rtol=1e-5, atol=1e-6)
    assert torch.all(z[2] == 0)


def test_cross_entropy_kernel_rejects_bad_shapes(interpret):
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        cross_entropy_grad_(torch.randn(4, 8), torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("bad", [40, -1, 1 << 40])
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_out_of_range_targets_are_refused(interpret, monkeypatch, bad, path):
    """A label past the vocabulary, or -1 with ignore_index -100 (transformers raises IndexError for both), would
    read outside its row in the kernel: refused, also through the fused loss, whose other targets stay valid. The
    torch form (a CPU without FXREWRITE_TRITON) gave "index 40 is out of bounds for dimension 1 with size 40", which
    does not say it is a label: it now refuses with the kernel path's message, an IndexError on a CPU, as torch's
    cross_entropy (code catching transformers' IndexError catches it; a fresh user's find)."""
    from fxrewrite.kernels.cross_entropy import cross_entropy_grad_torch

    monkeypatch.setenv("FXREWRITE_TRITON", "1" if path == "triton" else "0")
    grad = cross_entropy_grad_ if path == "triton" else cross_entropy_grad_torch
    target = torch.tensor([3, bad, -100, 0])
    with pytest.raises(IndexError, match=r"a target is outside \[0, 40\) and is not ignore_index=-100"):
        grad(torch.randn(4, 40), target)
    h, w = torch.randn(4, 8, requires_grad=True), torch.randn(40, 8, requires_grad=True)
    with pytest.raises(IndexError, match="a target is outside"):
        fused_linear_cross_entropy(h, w, None, target, kernel_params=(1.0, None))
    grad(torch.randn(4, 40), torch.tensor([3, 39, -100, 0]))  # the edges and ignore_index pass


def _softcap(z):
    return torch.tanh(z / 2.0) * 2.0


@pytest.mark.parametrize("transform,params", [(None, None), (_softcap, None), (_softcap, (1.0, 2.0)),
                                              (lambda z: z * 0.5, (0.5, None))])
@pytest.mark.parametrize("bias", [False, True])
def test_flce_matches_full_logits(interpret, monkeypatch, transform, params, bias):
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    gen = torch.Generator().manual_seed(1)
    N, H, V = 37, 16, 50
    h = torch.randn(N, H, generator=gen)
    w = torch.randn(V, H, generator=gen) * 0.3
    b = torch.randn(V, generator=gen) if bias else None
    t = torch.randint(0, V, (N,), generator=gen)
    t[::5] = -100
    leaves = [x.clone().requires_grad_() for x in (h, w) + ((b,) if bias else ())]
    got = fused_linear_cross_entropy(leaves[0], leaves[1], leaves[2] if bias else None, t, -100, transform,
                                     params, chunk_size=8)
    (got * 0.7).backward()
    ref_leaves = [x.clone().requires_grad_() for x in (h, w) + ((b,) if bias else ())]
    want = fused_linear_cross_entropy_ref(ref_leaves[0], ref_leaves[1], ref_leaves[2] if bias else None, t, -100,
                                          transform)
    (want * 0.7).backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, r in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=1e-6)


def test_flce_no_grad_and_shapes():
    h, w, t = torch.randn(5, 4), torch.randn(7, 4), torch.randint(0, 7, (5,))
    with torch.no_grad():
        got = fused_linear_cross_entropy(h, w, None, t, chunk_size=2)
    torch.testing.assert_close(got, F.cross_entropy(h @ w.T, t, reduction="sum"))
    with pytest.raises(ValueError, match="target"):
        fused_linear_cross_entropy(h, w, None, t[:4])


def test_default_chunk_size():
    assert default_chunk_size(16384, 151936) == 512
    assert default_chunk_size(10, 151936) == 10
    assert default_chunk_size(1 << 20, 1 << 26) == 64  # at least 64 rows
    # with the hidden size: logits chunk <= d/dweight [vocab, hidden] (Qwen3-0.6B, 8 x 2048 tokens: 1024 rows)
    assert default_chunk_size(16384, 151936, 1024) == 1024
    assert default_chunk_size(16384, 151936, 1000) == 512
    assert default_chunk_size(1 << 20, 151936, 256) == 512  # never below Liger's rule (capped at 2**27 logits)
    assert default_chunk_size(10, 151936, 1024) == 10
    assert default_chunk_size(1 << 20, 32000, 4096) == 4096  # capped at 2**27 logits
    # under checkpointing: logits no larger than one layer's gate/up output [N, 2I] (Qwen3-0.6B: 512 rows),
    # or than d/dweight when that is larger
    assert default_chunk_size(16384, 151936, 1024, intermediate=3072) == 1024
    assert default_chunk_size(16384, 151936, 512, intermediate=3072) == 512
    assert 512 * 151936 <= 16384 * 2 * 3072 < 1024 * 151936
    assert default_chunk_size(16384, 151936, 2560, intermediate=9728) == 2048  # Qwen3-4B
    assert default_chunk_size(10, 151936, 1024, intermediate=3072) == 10
    assert default_chunk_size(16384, 151936, 1024, intermediate=8) == 1024  # never below the rule without it


@pytest.mark.parametrize("bias", [False, True])
def test_flce_kernel_path_reuses_its_buffers(interpret, monkeypatch, bias):
    """The Triton path allocates its buffers once: per chunk only GEMMs into them and the kernel run (the
    number of allocations outside the kernel does not grow with the number of chunks; the interpreter's own
    copies are not counted), with the reference's values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import fxrewrite.kernels.fused_linear_cross_entropy as flce

    monkeypatch.setenv("FXREWRITE_TRITON", "1")

    class CountAllocs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count, self.paused = 0, False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            fresh = all(r.alias_info is None for r in func._schema.returns)  # not a view, not an out= write
            self.count += not self.paused and fresh and isinstance(out, torch.Tensor)
            return out

    kernel = flce.cross_entropy_grad_

    def uncounted_kernel(*args, **kwargs):
        mode.paused = True
        try:
            return kernel(*args, **kwargs)
        finally:
            mode.paused = False

    monkeypatch.setattr(flce, "cross_entropy_grad_", uncounted_kernel)

    gen = torch.Generator().manual_seed(3)
    h, w = torch.randn(32, 8, generator=gen), torch.randn(40, 8, generator=gen) * 0.3
    b = torch.randn(40, generator=gen) if bias else None
    t = torch.randint(0, 40, (32,), generator=gen)
    counts = []
    for chunk in (16, 4):
        leaves = [x.clone().requires_grad_() for x in (h, w) + ((b,) if bias else ())]
        with CountAllocs() as mode:
            got = fused_linear_cross_entropy(leaves[0], leaves[1], leaves[2] if bias else None, t, -100, None,
                                             (1.0, None), chunk_size=chunk)
        counts.append(mode.count)
        want = fused_linear_cross_entropy_ref(h, w, b, t)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert counts[0] == counts[1], counts
