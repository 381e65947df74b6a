"""Kernels under torch.compile: Inductor sees the references' torch ops, not Triton launches."""

from __future__ import annotations

import torch

from fxrewrite.kernels.activation import silu_and_mul
from fxrewrite.kernels.rms_norm import rms_norm


def test_compiled_graph_holds_torch_ops_not_triton_launches(monkeypatch, interpret):
    """With Triton forced on (interpreter), eager calls launch kernels, but a dynamo trace records the
    references' plain ops in one graph, which Inductor can fuse with the neighbours."""
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def block(x, residual, w, gate_up):
        h, residual = rms_norm(x, w, 1e-6, residual)
        return h + silu_and_mul(gate_up).sum(-1, keepdim=True), residual

    x, res, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    gate_up = torch.randn(4, 64)
    eager = block(x, res, w, gate_up)
    compiled = torch.compile(block, backend=backend, fullgraph=True)(x, res, w, gate_up)
    assert len(graphs) == 1
    targets = " ".join(str(n.target) for n in graphs[0].graph.nodes)
    assert "triton" not in targets
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
