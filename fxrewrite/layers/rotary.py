"""Rotary position embedding: a cos/sin cache per rope_type and its application to q and k.

The cache holds float32 `cos(p * inv_freq) * attention_scaling` then `sin(...)` for every position,
built with the same float32 ops as transformers' rotary modules (`freqs = positions.float() *
inv_freq; emb.cos() * attention_scaling`), so a cast to the input dtype reproduces them exactly.
Two types depend on a sequence length L, as in transformers' `dynamic_rope_update`: dynamic NTK (the
base grows with L past max_position_embeddings) and longrope (long_factor once L exceeds
original_max_position_embeddings). L is per token when the serving engine sets it
(`fxrewrite.layers.rope_context`: each token's own sequence, never its batch neighbours), else
transformers' max(positions) + 1 of the call. Both are chosen with `torch.where`, never a host sync.
Unlike transformers' stateful module (which keeps a grown dynamic base until a batch falls back
below max_position_embeddings), the result depends on these positions (and lengths) only.

Positions past the cache: the serving engine sizes the cache to cover its max_model_len (`cover_positions`:
its positions are bounded, so the cache is read directly and handed to the kernels). Anywhere else (training,
`generate` after `fxrewrite.optimize`, packed position ids) nothing bounds them, so cos/sin are computed from
the inverse frequencies for the given positions, as transformers computes them (the same float32 ops as the
cache), and no position can index past it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fxrewrite.errors import UserInputError
from fxrewrite.kernels.rotary import rotary_embedding
from fxrewrite.layers.rope_context import get_rope_lengths
from fxrewrite.layers.rope_init import (
    compute_inv_freq,
    get_rotary_dim,
    normalize_rope_parameters,
    validate_rope_parameters,
)


def _cos_sin_cache(inv_freq: torch.Tensor, attention_scaling: float, length: int) -> torch.Tensor:
    """float32 [length, 2 * len(inv_freq)]: cos half then sin half, scaled."""
    positions = torch.arange(length, device=inv_freq.device, dtype=torch.int64)
    return _cos_sin_at(positions, inv_freq, attention_scaling)


def _cos_sin_at(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float) -> torch.Tensor:
    freqs = positions[..., None].float() * inv_freq.to(device=positions.device, dtype=torch.float)
    return torch.cat((freqs.cos() * attention_scaling, freqs.sin() * attention_scaling), dim=-1)


def _cache_length(max_position: int, rope_parameters: dict[str, Any]) -> int:
    """Positions the static cache covers: the model's length, or the scaled one when larger."""
    rope_type = rope_parameters["rope_type"]
    factor = rope_parameters.get("factor") or 1.0
    if rope_type == "yarn":
        scaled = rope_parameters["original_max_position_embeddings"] * factor
    elif rope_type == "linear":
        scaled = max_position * factor
    else:  # llama3 / longrope lengths are already scaled; dynamic is computed past max_position
        scaled = max_position
    return max(max_position, int(scaled))


def _layout(cos_sin: torch.Tensor, is_neox_style: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rotary_dim] (cos half, sin half) -> cos, sin [..., rotary_dim] in transformers' layout."""
    cos, sin = cos_sin.chunk(2, dim=-1)
    if is_neox_style:
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)


class RotaryEmbedding(nn.Module):
    """RoPE for `head_size`-wide heads, rotating the first `rotary_dim` channels of each head.

    Attributes: head_size, rotary_dim, is_neox_style (rotate halves; False: GPT-J interleaved pairs),
    attention_scaling (YaRN / longrope factor already folded into the cache), rope_parameters.
    Buffer `cos_sin_cache` float32 [max(max_position, scaled length), rotary_dim] (cos half then
    sin half, non-persistent); longrope adds `long_cos_sin_cache` of the same shape.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        rope_parameters: dict[str, Any],
        is_neox_style: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.rope_parameters = dict(rope_parameters)
        self.rope_type = self.rope_parameters["rope_type"]
        self.is_neox_style = is_neox_style
        self.dtype = dtype or torch.float32
        self.max_cache_len = _cache_length(max_position_embeddings, self.rope_parameters)
        self.positions_bounded = False
        """True once `cover` promised every position < max_cache_len (the serving engine): the cache is then
        read directly; else cos/sin are computed for the positions given (nothing indexes past the cache)."""
        self.attention_scaling = 1.0
        self.register_buffer("cos_sin_cache", torch.empty(0, device=device), persistent=False)
        self.register_buffer("inv_freq", torch.empty(0, device=device), persistent=False)
        if self.rope_type == "longrope":
            self.register_buffer("long_cos_sin_cache", torch.empty(0, device=device), persistent=False)
            self.register_buffer("long_inv_freq", torch.empty(0, device=device), persistent=False)
        self.rebuild_cache(device)

    def rebuild_cache(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the cache on `device` (default: where the buffer lives), e.g. after to_empty()."""
        device = device if device is not None else self.cos_sin_cache.device
        self.inv_freq, self.attention_scaling = self._inv_freq(None, device)
        self.cos_sin_cache = _cos_sin_cache(self.inv_freq, self.attention_scaling, self.max_cache_len)
        if self.rope_type == "longrope":
            original = self.rope_parameters["original_max_position_embeddings"]
            self.long_inv_freq, _ = self._inv_freq(original + 1, device)
            self.long_cos_sin_cache = _cos_sin_cache(self.long_inv_freq, self.attention_scaling, self.max_cache_len)

    def cover(self, max_positions: int) -> None:
        """Promise that every position is < `max_positions` (the serving engine's max_model_len), growing the
        cache when it is shorter (positions past max_position_embeddings rotate as transformers rotates them).
        From then on the cache is read directly, by the table path and the fused kernels alike."""
        if max_positions > self.max_cache_len:
            self.max_cache_len = int(max_positions)
            self.rebuild_cache()
        self.positions_bounded = True

    def _inv_freq(self, seq_len, device) -> tuple[torch.Tensor, float]:
        return compute_inv_freq(self.rope_parameters, self.rotary_dim, self.max_position_embeddings, seq_len, device)

    def _cos_sin_cat(self, positions: torch.Tensor) -> torch.Tensor:
        """float32 [*positions.shape, rotary_dim] (cos half, sin half) for this batch of positions."""
        if positions.numel() == 0:
            return self.cos_sin_cache.new_empty(*positions.shape, self.rotary_dim)
        if self.rope_type not in ("dynamic", "longrope"):
            return self._rows(positions, self.cos_sin_cache, self.inv_freq)
        seq_len = get_rope_lengths(positions)  # per token; else transformers' one length for the call
        seq_len = positions.max() + 1 if seq_len is None else seq_len[..., None]
        if self.rope_type == "dynamic":
            return self._dynamic_cos_sin(positions, seq_len)
        original = self.rope_parameters["original_max_position_embeddings"]
        return torch.where(seq_len > original, self._rows(positions, self.long_cos_sin_cache, self.long_inv_freq),
                           self._rows(positions, self.cos_sin_cache, self.inv_freq))

    def _rows(self, positions: torch.Tensor, cache: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """The cache's rows at `positions` where `cover` bounded them, else the same values computed."""
        if self.positions_bounded:
            return cache[positions]
        return _cos_sin_at(positions, inv_freq, self.attention_scaling)

    def _dynamic_cos_sin(self, positions: torch.Tensor, seq_len: torch.Tensor) -> torch.Tensor:
        """Dynamic NTK: the base follows seq_len (a scalar, or [*positions.shape, 1]) once it passes
        max_position_embeddings."""
        cached = self.cos_sin_cache[positions.clamp(max=self.max_cache_len - 1)]
        inv_freq, _ = self._inv_freq(seq_len, positions.device)
        scaled = _cos_sin_at(positions, inv_freq, self.attention_scaling)
        return torch.where(seq_len > self.max_position_embeddings, scaled, cached)

    def get_cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin each [*positions.shape, rotary_dim] in transformers' layout, times attention_scaling.

        Neox style duplicates the halves (`cat(freqs, freqs)`, as LlamaRotaryEmbedding returns);
        GPT-J style repeats each frequency twice (interleaved). Computed in float32 and cast to
        `dtype` (default: the dtype given to get_rope, else float32), like transformers' modules.
        """
        dtype = dtype or self.dtype
        table = self.cos_sin_table(dtype)
        if table is not None:  # one gather instead of five launches (the same values)
            rows = table[positions]
            return rows[..., : self.rotary_dim], rows[..., self.rotary_dim :]
        cos, sin = _layout(self._cos_sin_cat(positions), self.is_neox_style)
        return cos.to(dtype), sin.to(dtype)

    def cos_sin_table(self, dtype: torch.dtype) -> torch.Tensor | None:
        """`dtype` [max_cache_len, 2 * rotary_dim]: row p is get_cos_sin's cos then sin at position p (cast
        from the float32 cache, so the same values). Built once per dtype and cache buffer, at inference
        only; None while autograd records or torch.compile traces, for the length-dependent types (their rows
        depend on the batch), until `cover` bounds the positions, and during a CUDA graph capture before it
        exists (a table built there would hold nothing until the graph replays). For neox, columns [rotary_dim/2, 3 * rotary_dim/2) of a row
        are the cos half then the sin half: `cos_sin_cache`'s layout (the rotary kernels' table), in `dtype`.
        """
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or self.rope_type in ("dynamic", "longrope") \
                or not self.positions_bounded:
            return None
        source = self.cos_sin_cache
        if source.is_meta:
            return None
        tables = self.__dict__.get("_tables")  # (the cache it was built from, {dtype: table}); not a buffer
        if tables is None or tables[0] is not source:
            tables = self.__dict__["_tables"] = (source, {})
        table = tables[1].get(dtype)
        if table is None and not (source.is_cuda and torch.cuda.is_current_stream_capturing()):
            table = tables[1][dtype] = torch.cat(_layout(source, self.is_neox_style), dim=-1).to(dtype)
        return table

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotate query and key: positions int64 [T] or [B, S]; query/key [*positions.shape, H * D]
        or [*positions.shape, H, D] (any H; D = head_size). Returns tensors of the same shapes and
        dtypes (use the returned ones: the Triton kernel on CUDA rotates in place); the math runs
        in the input dtype with cos/sin cast to it, as transformers does. Inputs that require grad
        take a differentiable torch path.
        """
        needs_grad = query.requires_grad or (key is not None and key.requires_grad)
        if not needs_grad and positions.numel() > 0:
            return self._forward_kernel(positions, query, key)
        cos, sin = self._cos_sin_cat(positions).chunk(2, dim=-1)
        lead = positions.shape
        query = self._rotate(query, lead, cos, sin)
        key = self._rotate(key, lead, cos, sin) if key is not None else None
        return query, key

    def _forward_kernel(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fxrewrite.kernels.rotary (Triton on CUDA, in place; torch reference elsewhere)."""
        if self.rope_type in ("dynamic", "longrope") or not self.positions_bounded:  # this batch's rows as the cache
            flat = positions.flatten()
            cache = self._cos_sin_cat(flat)
            positions = torch.arange(flat.numel(), device=flat.device)
        else:
            cache = self.cos_sin_cache
        return rotary_embedding(positions, query, key, self.head_size, cache, self.is_neox_style)

    def _rotate(self, x: torch.Tensor, lead: torch.Size, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(*lead, -1, self.head_size)
        cos, sin = cos.to(x.dtype).unsqueeze(-2), sin.to(x.dtype).unsqueeze(-2)
        x_rot, x_pass = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.is_neox_style:
            x1, x2 = x_rot.chunk(2, dim=-1)
            x_rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
            x_rot = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((x_rot, x_pass), dim=-1).reshape(shape)

    def extra_repr(self) -> str:
        """The rotary shape in the module's repr."""
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, rope_type={self.rope_type!r}, "
            f"max_position={self.max_position_embeddings}, is_neox_style={self.is_neox_style}, "
            f"attention_scaling={self.attention_scaling:.6g}"
        )


def cover_positions(model: nn.Module, max_positions: int) -> int:
    """`RotaryEmbedding.cover(max_positions)` for every rotary module in `model` (the serving engine, before
    its warm-up and CUDA graphs: their kernels read the cache directly). Returns how many were covered."""
    ropes = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    for rope in ropes:
        rope.cover(max_positions)
    return len(ropes)


def get_rope(
    head_size: int,
    max_position: int,
    rope_parameters: dict[str, Any],
    is_neox_style: bool = True,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> RotaryEmbedding:
    """Build the RotaryEmbedding for one attention layer.

    `max_position` is the model's `max_position_embeddings` (dynamic NTK's reference length; the
    cache covers it, or original_max_position_embeddings * factor for yarn / max_position * factor
    for linear when larger). `rope_parameters` is transformers' flat dict (legacy `type` accepted);
    rotary_dim = int(head_size * partial_rotary_factor). `dtype` is what get_cos_sin returns by
    default. Raises UserInputError (a ValueError) for invalid parameters (see
    rope_init.validate_rope_parameters).
    """
    params = normalize_rope_parameters(rope_parameters)
    validate_rope_parameters(params, head_size)
    rotary_dim = get_rotary_dim(head_size, params)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_size:
        raise UserInputError(
            f"rotary_dim = int(head_size * partial_rotary_factor) = {rotary_dim} must be even and in "
            f"(0, head_size={head_size}] (head_dim / partial_rotary_factor of the config)"
        )
    return RotaryEmbedding(head_size, rotary_dim, max_position, params, is_neox_style, dtype, device)
