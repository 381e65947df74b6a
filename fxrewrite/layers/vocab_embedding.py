"""Vocabulary-parallel embedding and LM head (vLLM's `VocabParallelEmbedding`, `ParallelLMHead`).

The vocabulary is padded to a multiple of tp_size and split into equal contiguous row ranges,
one per rank: rank r holds rows [r * V_p, (r + 1) * V_p) of the padded table, V_p =
ceil(V / tp_size). Padding rows are zero. At tp_size 1 both are exactly `nn.Embedding` /
`nn.Linear` (same parameter shapes and names), so checkpoints and tying work unchanged.
Layout follows vLLM `vllm/model_executor/layers/vocab_parallel_embedding.py` (without the LoRA
and 64-row padding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fxrewrite.distributed import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from fxrewrite.layers.linear import dispatch_linear


class VocabParallelEmbedding(nn.Module):
    """ids [...] int64 -> embeddings [..., embedding_dim]; each rank looks up its rows, then all-reduce.

    weight [num_embeddings_per_partition, embedding_dim]; `weight.weight_loader(param, full)` copies
    this rank's rows of a full [num_embeddings, embedding_dim] tensor (padding rows set to zero).
    ValueError for tp_rank outside [0, tp_size).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_size: int = 1, tp_rank: int = 0,
                 params_dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"expected 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.num_embeddings_per_partition = -(-num_embeddings // tp_size)
        self.vocab_start_index = tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        factory = {"dtype": params_dtype or torch.get_default_dtype(), "device": device}
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim, **factory))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id=None) -> None:
        """Copy rows [vocab_start_index, vocab_end_index) of a full [num_embeddings, ...] tensor."""
        if loaded_shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shards, got loaded_shard_id={loaded_shard_id!r}")
        if loaded_weight.shape[0] != self.num_embeddings or tuple(loaded_weight.shape[1:]) != tuple(param.shape[1:]):
            raise ValueError(f"weight shape {tuple(loaded_weight.shape)} does not match "
                             f"({self.num_embeddings}, {', '.join(map(str, param.shape[1:]))})")
        rows = max(0, min(self.vocab_end_index, self.num_embeddings) - self.vocab_start_index)
        if param.device.type == "meta":
            return
        with torch.no_grad():
            param.data[rows:].zero_()
            if rows:
                param.data[:rows].copy_(loaded_weight.narrow(0, self.vocab_start_index, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [...] int64 -> [..., embedding_dim], weight dtype (other ranks' ids: 0 before the all-reduce)."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start_index
        outside = (local < 0) | (local >= self.num_embeddings_per_partition)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)

    def extra_repr(self) -> str:
        """Vocabulary sizes, embedding_dim and tp_size in the module's repr."""
        return (f"num_embeddings={self.num_embeddings}, per_partition={self.num_embeddings_per_partition}, "
                f"embedding_dim={self.embedding_dim}, tp_size={self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """hidden [..., H] -> logits [..., num_embeddings]: each rank computes its vocabulary slice, then
    all-gather (every rank gets the full logits; padding columns dropped).

    weight [num_embeddings_per_partition, H] (can be the same Parameter as the embedding's: tied
    weights shard identically); optional bias [num_embeddings_per_partition].
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, bias: bool = False, tp_size: int = 1,
                 tp_rank: int = 0, params_dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__(num_embeddings, embedding_dim, tp_size=tp_size, tp_rank=tp_rank,
                         params_dtype=params_dtype, device=device)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.num_embeddings_per_partition, dtype=self.weight.dtype,
                                                 device=self.weight.device))
            self.bias.weight_loader = self._bias_loader
        else:
            self.register_parameter("bias", None)

    def _bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id=None) -> None:
        rows = max(0, min(self.vocab_end_index, self.num_embeddings) - self.vocab_start_index)
        if param.device.type != "meta":
            with torch.no_grad():
                param.data[rows:].zero_()
                param.data[:rows].copy_(loaded_weight.narrow(0, self.vocab_start_index, rows))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [..., H] -> logits [..., num_embeddings] in the weight's dtype (all ranks get all of them)."""
        logits = dispatch_linear(hidden_states, self.weight, self.bias)  # the skinny GEMV where chosen
        if self.tp_size == 1:
            return logits
        return tensor_model_parallel_all_gather(logits, dim=-1)[..., : self.num_embeddings]
