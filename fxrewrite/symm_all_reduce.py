"""Latency-bound all-reduce for tensor parallelism through PyTorch's symmetric memory.

A decode step all-reduces a few KB twice per layer; NCCL's ring spends ~30 us on each such message.
With NVLink peer access every rank can read the others' buffers directly: the input is copied into a
symmetric buffer (`torch.distributed._symmetric_memory`, one allocation mapped on every rank) and
`one_shot_all_reduce` (each rank reads all peers, small messages) or `two_shot_all_reduce_` (reduce-scatter
+ all-gather through peer memory, medium messages) sums it. Both are CUDA-graph capturable: the
captured kernels read peer pointers from a device array, and their signal pads synchronise the ranks.
Larger messages, CPUs and GPUs without peer access keep NCCL/gloo (`fxrewrite.distributed`).

Sizes follow the split vLLM and SGLang use for their symmetric-memory communicators (one-shot for the
smallest messages, two-shot up to a few MiB at 2 ranks).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

ONE_SHOT_MAX_BYTES = 256 * 1024
MAX_BYTES = {2: 8 << 20, 4: 8 << 20, 6: 8 << 20, 8: 8 << 20}
"""Largest message (bytes) per TP size that goes through symmetric memory; NCCL above."""


class SymmMemAllReduce:
    """Sum over `group` for contiguous CUDA tensors of one dtype up to `max_bytes`.

    `__call__(x)` writes the sum into `x` (any shape) and returns it. Build with `create`, which
    returns None where symmetric memory cannot be used (logged once)."""

    def __init__(self, group, buffer: torch.Tensor, max_bytes: int):
        self.group_name = group.group_name
        self.buffer = buffer
        self.max_bytes = max_bytes

    @classmethod
    def create(cls, group, device: torch.device, dtype: torch.dtype) -> SymmMemAllReduce | None:
        """A communicator for the ranks of `group` (collective: every rank calls it), or None when the
        world size is not 2/4/6/8, a peer is not reachable over P2P, or torch lacks symmetric memory."""
        world = dist.get_world_size(group)
        max_bytes = MAX_BYTES.get(world)
        if device.type != "cuda" or max_bytes is None:
            return None
        try:
            import torch.distributed._symmetric_memory as symm_mem  # optional: absent on some builds

            index = device.index if device.index is not None else torch.cuda.current_device()
            peers = [torch.cuda.can_device_access_peer(index, i) for i in range(torch.cuda.device_count()) if i != index]
            if not all(peers):
                raise RuntimeError("not every GPU pair has peer access")
            itemsize = torch.empty((), dtype=dtype).element_size()
            buffer = symm_mem.empty(max_bytes // itemsize, dtype=dtype, device=device)
            symm_mem.rendezvous(buffer, group.group_name)
        except Exception as e:  # noqa: BLE001 - any failure here only means "use NCCL"
            logger.warning("symmetric-memory all-reduce unavailable, using NCCL for every message: %s", e)
            return None
        return cls(group, buffer, max_bytes)

    def can_run(self, x: torch.Tensor) -> bool:
        """Whether `x` goes through symmetric memory (same answer on every rank for the same shape)."""
        return (x.is_cuda and x.dtype == self.buffer.dtype and x.is_contiguous()
                and x.numel() * x.element_size() <= self.max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        staged = self.buffer[:n]
        staged.copy_(x.view(-1))
        if n * x.element_size() <= ONE_SHOT_MAX_BYTES:
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out=x.view(-1))
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
            x.view(-1).copy_(staged)
        return x
