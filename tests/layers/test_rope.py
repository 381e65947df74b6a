"""RoPE cos/sin against transformers: ROPE_INIT_FUNCTIONS and real HF rotary modules (issue 2, item 6)."""

import math
import random

import pytest
import torch
from transformers import GPTNeoXConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from fxrewrite.layers.rope_init import SUPPORTED_ROPE_TYPES, compute_inv_freq
from fxrewrite.layers.rotary import get_rope

NUM_HEADS = 2
SEEDS = range(2)


def random_rope(rope_type: str, head_size: int, partial: float, seed: int) -> tuple[dict, int]:
    """Seeded valid rope_parameters of `rope_type` and the model's max_position_embeddings."""
    rng = random.Random(f"{rope_type}-{head_size}-{partial}-{seed}")
    params = {"rope_type": rope_type, "rope_theta": rng.choice([10000.0, 500000.0, 1e6, rng.uniform(1e3, 1e6)])}
    if partial != 1.0:
        params["partial_rotary_factor"] = partial
    original = rng.choice([512, 1024, 2048])
    max_pos = original
    if rope_type in ("linear", "dynamic") or (rope_type == "proportional" and seed % 2):
        params["factor"] = rng.uniform(1.0, 8.0)
    elif rope_type == "yarn":
        params.update(factor=rng.uniform(1.5, 16.0), original_max_position_embeddings=original)
        max_pos = int(original * params["factor"])
        optional = {
            "beta_fast": rng.uniform(8, 64),
            "beta_slow": rng.uniform(0.25, 2),
            "truncate": rng.random() < 0.5,
            "attention_factor": rng.uniform(0.5, 2.0),
            "mscale": rng.uniform(0.5, 1.5),
            "mscale_all_dim": rng.uniform(0.5, 1.5),
        }
        params.update({k: v for k, v in optional.items() if rng.random() < 0.5})
    elif rope_type == "llama3":
        low = rng.uniform(0.5, 2.0)
        params.update(factor=rng.uniform(2.0, 16.0), low_freq_factor=low, high_freq_factor=low + rng.uniform(1, 4))
        params["original_max_position_embeddings"] = original
        max_pos = int(original * params["factor"])
    elif rope_type == "longrope":
        half = int(head_size * partial) // 2
        params["short_factor"] = [rng.uniform(1.0, 4.0) for _ in range(half)]
        params["long_factor"] = [rng.uniform(1.0, 64.0) for _ in range(half)]
        params["original_max_position_embeddings"] = original
        max_pos = original * rng.choice([4, 8, 16])
        if rng.random() < 0.5:
            params["factor"] = max_pos / original
        if rng.random() < 0.3:
            params["attention_factor"] = rng.uniform(0.8, 1.5)
    return params, max_pos


def hf_rotary(params: dict, head_size: int, max_pos: int):
    """A real transformers rotary module for these parameters (Phi-3 for longrope, GPT-NeoX else:
    both honour partial_rotary_factor in their default rope)."""
    common = dict(hidden_size=head_size * NUM_HEADS, num_attention_heads=NUM_HEADS, max_position_embeddings=max_pos)
    params = {"partial_rotary_factor": 1.0, **params}
    if params["rope_type"] == "longrope":
        original = params["original_max_position_embeddings"]
        config = Phi3Config(**common, original_max_position_embeddings=original, rope_parameters=dict(params))
        return Phi3RotaryEmbedding(config), config
    config = GPTNeoXConfig(**common, rope_parameters=dict(params))
    return GPTNeoXRotaryEmbedding(config), config


def hf_cos_sin(params: dict, head_size: int, max_pos: int, positions: torch.Tensor, dtype=torch.float32):
    module, _ = hf_rotary(params, head_size, max_pos)  # fresh: dynamic/longrope modules keep state
    return module(torch.zeros(1, dtype=dtype), positions[None])


def probe_positions(params: dict, max_pos: int, rope: torch.nn.Module) -> list[torch.Tensor]:
    """Batches below original_max_position_embeddings, and reaching past it (past max_pos for dynamic)."""
    gen = torch.Generator().manual_seed(0)
    original = params.get("original_max_position_embeddings", max_pos)
    top = 2 * max_pos if params["rope_type"] == "dynamic" else rope.max_cache_len
    short = torch.cat([torch.arange(8), torch.randint(0, original, (24,), generator=gen), torch.tensor([original - 1])])
    long = torch.cat([torch.arange(4), torch.randint(0, top, (28,), generator=gen), torch.tensor([top - 1])])
    if params["rope_type"] not in ("dynamic", "longrope"):
        return [short, long]
    edge = max_pos if params["rope_type"] == "dynamic" else original  # first length that switches
    return [short, long, torch.tensor([0, 5, edge - 1]), torch.tensor([0, 5, edge])]


# every type the installed transformers implements too ("proportional" arrived with Gemma 4)
ROPE_TYPES = [t for t in SUPPORTED_ROPE_TYPES if t == "default" or t in ROPE_INIT_FUNCTIONS]

CASES = [
    (rope_type, head_size, partial, seed)
    for rope_type in ROPE_TYPES
    for head_size in (64, 128)
    for partial in (0.5, 1.0)
    for seed in SEEDS
]


@pytest.mark.parametrize("rope_type,head_size,partial,seed", CASES)
def test_cos_sin_match_transformers_module(rope_type, head_size, partial, seed):
    params, max_pos = random_rope(rope_type, head_size, partial, seed)
    rope = get_rope(head_size, max_pos, params)
    assert rope.rotary_dim == (head_size if rope_type == "proportional" else int(head_size * partial))
    for positions in probe_positions(params, max_pos, rope):
        hf_cos, hf_sin = hf_cos_sin(params, head_size, max_pos, positions)
        cos, sin = rope.get_cos_sin(positions)
        assert cos.shape == (*positions.shape, rope.rotary_dim)
        torch.testing.assert_close(cos, hf_cos[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(sin, hf_sin[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("rope_type", [t for t in ROPE_TYPES if t != "default"])
@pytest.mark.parametrize("head_size,partial", [(64, 1.0), (128, 0.5)])
def test_inv_freq_and_attention_factor_match_rope_init_functions(rope_type, head_size, partial):
    for seed in SEEDS:
        params, max_pos = random_rope(rope_type, head_size, partial, seed)
        _, config = hf_rotary(params, head_size, max_pos)
        dim = head_size if rope_type == "proportional" else int(head_size * partial)
        original = params.get("original_max_position_embeddings", max_pos)
        for seq_len in (None, original + 1, 3 * max_pos):
            ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)
            inv_freq, factor = compute_inv_freq(dict(config.rope_parameters), dim, max_pos, seq_len)
            torch.testing.assert_close(inv_freq, ref_inv_freq, atol=0, rtol=0)
            assert math.isclose(factor, ref_factor, rel_tol=1e-12)


def test_seed_yarn_example_attention_factor():
    params = {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    rope = get_rope(128, 40960, params)
    assert rope.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1)
    assert rope.cos_sin_cache.shape == (131072, 128)


def test_yarn_explicit_attention_factor_is_kept():
    # vLLM's plain-yarn path drops an explicit attention_factor (DESIGN.md): we must not.
    params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "attention_factor": 0.5}
    rope = get_rope(64, 1024, params)
    assert rope.attention_scaling == 0.5
    cos, sin = rope.get_cos_sin(torch.tensor([0]))
    assert torch.allclose(cos, torch.full_like(cos, 0.5)) and torch.all(sin == 0)


def test_dynamic_base_grows_with_sequence_length():
    params = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    rope = get_rope(64, 256, params)
    inside = rope.get_cos_sin(torch.arange(10))[0]
    past = rope.get_cos_sin(torch.arange(1000))[0][:10]
    assert not torch.allclose(inside, past), "dynamic NTK must not be a constant base"
    torch.testing.assert_close(inside, get_rope(64, 256, {"rope_type": "default"}).get_cos_sin(torch.arange(10))[0])


def test_longrope_picks_long_factor_for_the_whole_batch_past_original():
    params, max_pos = random_rope("longrope", 64, 1.0, 0)
    original = params["original_max_position_embeddings"]
    rope = get_rope(64, max_pos, params)
    short = rope.get_cos_sin(torch.tensor([5, original - 1]))[0]
    mixed = rope.get_cos_sin(torch.tensor([5, original]))[0]
    assert not torch.allclose(short[0], mixed[0])


def hf_apply(q, cos, sin, is_neox_style):
    """transformers' apply_rotary_pos_emb (Llama: rotate_half; GPT-J: rotate_every_two), partial aware."""
    rot = cos.shape[-1]
    q_rot, q_pass = q[..., :rot], q[..., rot:]
    if is_neox_style:
        rotated = torch.cat((-q_rot[..., rot // 2 :], q_rot[..., : rot // 2]), dim=-1)
    else:
        rotated = torch.stack((-q_rot[..., 1::2], q_rot[..., ::2]), dim=-1).flatten(-2)
    return torch.cat((q_rot * cos + rotated * sin, q_pass), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope_type,partial,is_neox_style", [
    ("yarn", 0.5, True), ("yarn", 1.0, False), ("dynamic", 1.0, True), ("longrope", 0.5, False),
    ("default", 1.0, True),
])
@pytest.mark.parametrize("requires_grad", [False, True])  # kernel path / differentiable torch path
def test_forward_rotates_like_transformers(dtype, rope_type, partial, is_neox_style, requires_grad):
    head_size, num_heads, num_kv_heads = 64, 4, 2
    params, max_pos = random_rope(rope_type, head_size, partial, seed=0)
    rope = get_rope(head_size, max_pos, params, is_neox_style=is_neox_style, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 2 * max_pos if rope_type == "dynamic" else max_pos, (2, 7), generator=gen)
    query = torch.randn(2, 7, num_heads * head_size, generator=gen).to(dtype).requires_grad_(requires_grad)
    key = torch.randn(2, 7, num_kv_heads, head_size, generator=gen).to(dtype)
    q_out, k_out = rope(positions, query, key)
    assert q_out.shape == query.shape and k_out.shape == key.shape and q_out.dtype == dtype
    assert q_out.requires_grad == requires_grad
    cos, sin = (t.unsqueeze(-2) for t in rope.get_cos_sin(positions, dtype=dtype))
    expected_q = hf_apply(query.view(2, 7, num_heads, head_size), cos, sin, is_neox_style).view_as(query)
    torch.testing.assert_close(q_out, expected_q, atol=0, rtol=0)
    torch.testing.assert_close(k_out, hf_apply(key, cos, sin, is_neox_style), atol=0, rtol=0)
    flat_q, none_key = rope(positions.flatten(), query.reshape(14, -1), None)
    assert none_key is None
    torch.testing.assert_close(flat_q, q_out.reshape(14, -1), atol=0, rtol=0)


def test_get_cos_sin_casts_like_transformers_module():
    params, max_pos = random_rope("yarn", 128, 1.0, 1)
    positions = torch.arange(0, max_pos, 97)
    hf_cos, hf_sin = hf_cos_sin(params, 128, max_pos, positions, dtype=torch.bfloat16)
    cos, sin = get_rope(128, max_pos, params, dtype=torch.bfloat16).get_cos_sin(positions)
    assert cos.dtype == torch.bfloat16
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])


def test_meta_device_builds_then_rebuilds():
    rope = get_rope(64, 128, {"rope_type": "default"}, device="meta")
    assert rope.cos_sin_cache.is_meta
    rope.to_empty(device="cpu")
    rope.rebuild_cache()
    expected = get_rope(64, 128, {"rope_type": "default"}).cos_sin_cache
    assert torch.equal(rope.cos_sin_cache, expected)


@pytest.mark.parametrize("is_neox_style", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_table_gives_the_same_cos_sin(dtype, is_neox_style):
    """At inference get_cos_sin gathers rows of one table per dtype (one launch, not five): the same values;
    the table follows the cache buffer (a rebuilt or moved cache gets a new one) and serves no batch-dependent type."""
    params, max_pos = random_rope("yarn", 64, 0.5, 0)
    rope = get_rope(64, max_pos, params, is_neox_style)
    positions = torch.tensor([[0, 5, 17, max_pos - 1]])
    want = rope.get_cos_sin(positions, dtype)  # autograd on: computed per call, no table
    assert rope.cos_sin_table(dtype) is None
    with torch.inference_mode():
        assert rope.cos_sin_table(dtype) is None  # nothing bounds the positions yet (not the engine)
    rope.cover(max_pos)
    with torch.inference_mode():
        got = rope.get_cos_sin(positions, dtype)
        table = rope.cos_sin_table(dtype)
    assert table.shape == (rope.max_cache_len, 2 * rope.rotary_dim) and table.dtype == dtype
    assert len(got) == len(want) == 2  # (cos, sin)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    if is_neox_style:  # the rotary kernels' layout (cos half | sin half) in the middle columns
        half = rope.rotary_dim // 2
        assert torch.equal(table[:, half: 3 * half], rope.cos_sin_cache.to(dtype))
    with torch.no_grad():
        assert rope.cos_sin_table(dtype) is table
        rope.rebuild_cache()
        assert rope.cos_sin_table(dtype) is not table
    dynamic = get_rope(64, 128, {"rope_type": "dynamic", "factor": 2.0})
    with torch.no_grad():
        assert dynamic.cos_sin_table(torch.float32) is None


@pytest.mark.parametrize("rope_type", ["default", "yarn", "linear", "llama3", "longrope"])
def test_positions_past_the_cache_rotate_as_transformers(rope_type):
    """Nothing bounds the positions outside the engine (training, generate after optimize, packed position ids):
    cos/sin past max_position_embeddings (and past the scaled length) are transformers' own, not an IndexError;
    `cover` grows the cache to the engine's length with the same values."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params, max_pos = random_rope(rope_type, 64, 1.0, 3)
    config = LlamaConfig(hidden_size=64 * 4, num_attention_heads=4, head_dim=64, max_position_embeddings=max_pos,
                         rope_parameters=params)
    hf = LlamaRotaryEmbedding(config)
    rope = get_rope(64, max_pos, config.rope_parameters)
    far = rope.max_cache_len + 37
    positions = torch.tensor([[0, 3, max_pos - 1, far - 1, far]])
    x = torch.zeros(1, 5, 64)
    want = hf(x, positions)
    got = rope.get_cos_sin(positions, torch.float32)
    assert len(got) == len(want) == 2  # (cos, sin)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    rope.cover(far + 1)
    assert rope.max_cache_len == far + 1 and rope.cos_sin_cache.shape[0] == far + 1
    with torch.inference_mode():
        bounded = rope.get_cos_sin(positions, torch.float32)
    assert len(bounded) == len(got)
    assert all(torch.equal(b, g) for b, g in zip(bounded, got, strict=True))
