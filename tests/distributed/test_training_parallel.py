"""An optimized model under DDP and FSDP2 (2 gloo processes on CPU): same gradients as one process.

Each rank takes half of a batch of 4; both wrappers average gradients over ranks, so they must equal
the gradients of the mean of the two half-batch losses computed in one process.
"""

from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp

from tests.distributed.train_ranks import batch, fused_model, run_rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_and_fsdp2_match_single_process(tmp_path):
    out = tmp_path / "rank0.pt"
    mp.spawn(run_rank, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    results = torch.load(out)
    from fxrewrite.weights import to_hf_names

    model = fused_model()
    ids, labels = batch()
    halves = [model(ids[s], labels=labels[s]).loss for s in (slice(0, 2), slice(2, 4))]
    (sum(halves) / 2).backward()
    want = to_hf_names(model, {n: p.grad for n, p in model.named_parameters()})
    for kind, (loss0, grads) in results.items():
        assert abs(loss0 - float(halves[0].detach())) < 1e-6, kind
        assert set(grads) == set(want), kind
        for name, g in want.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=f"{kind} {name}")
