"""The sharding plan read off the fusion, vocab-parallel layers and sliced loading, in one process
(no collectives: shapes and loaded slices only; the numerics run in test_tensor_parallel.py)."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from fxrewrite.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from fxrewrite.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from fxrewrite.runtime.model_files.loader import iterate_safetensors
from fxrewrite.sharding import LazySlice, shard_model


def _optimized_qwen3(num_key_value_heads: int):
    import fxrewrite
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=num_key_value_heads, head_dim=8,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    return fxrewrite.optimize(Qwen3ForCausalLM(config).eval())


@pytest.mark.parametrize("num_kv_heads, kv_per_rank", [(2, 1), (1, 1)])
def test_fusion_drives_the_plan(num_kv_heads, kv_per_rank):
    model = _optimized_qwen3(num_kv_heads)
    full = {k: v.clone() for k, v in model.state_dict().items()}
    plan = shard_model(model, tp_rank=1, tp_size=2)
    layer = model.model.layers[0]
    assert plan["model.layers.0.self_attn.qkv_proj"] == "qkv"
    assert plan["model.layers.0.self_attn.o_proj"] == "rowwise"
    assert plan["model.layers.0.mlp.gate_up_proj"] == "merged"
    assert plan["model.layers.0.mlp.down_proj"] == "rowwise"
    assert plan["model.embed_tokens"] == plan["lm_head"] == "vocab"
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, QKVParallelLinear) and (qkv.num_heads, qkv.num_kv_heads) == (2, kv_per_rank)
    assert isinstance(layer.self_attn.o_proj, RowParallelLinear)
    assert isinstance(layer.mlp.gate_up_proj, MergedColumnParallelLinear)
    assert isinstance(model.model.embed_tokens, VocabParallelEmbedding)
    assert isinstance(model.lm_head, ParallelLMHead) and model.lm_head.weight is model.model.embed_tokens.weight
    # rank 1's slices of the original weights (vocab 101 -> 51 rows a rank, the last one padding)
    q = full["model.layers.0.self_attn.q_proj.weight"]
    torch.testing.assert_close(qkv.weight[:16], q[16:])
    k = full["model.layers.0.self_attn.k_proj.weight"]
    torch.testing.assert_close(qkv.weight[16:24], k[8:16] if num_kv_heads == 2 else k)
    o = full["model.layers.0.self_attn.o_proj.weight"]
    torch.testing.assert_close(layer.self_attn.o_proj.weight, o[:, 16:])
    emb = full["model.embed_tokens.weight"]
    torch.testing.assert_close(model.model.embed_tokens.weight[:50], emb[51:])
    assert torch.all(model.model.embed_tokens.weight[50] == 0)


def test_partner_comes_from_dataflow_not_width():
    """A second child reading the q width does not confuse the plan: the match recorded which linear the
    attention output reaches (o_proj); the MLP's partner is the one reading act(gate) * up."""
    model = _optimized_qwen3(2)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert (attn.qkv_proj.row_partner, mlp.gate_up_proj.row_partner) == ("o_proj", "down_proj")
    attn.extra = nn.Linear(32, 32)
    plan = shard_model(model, tp_rank=0, tp_size=2)
    assert plan["model.layers.0.self_attn.o_proj"] == "rowwise" and "model.layers.0.self_attn.extra" not in plan
    assert type(attn.extra) is nn.Linear


class _TwoReaders(nn.Module):
    """q/k/v whose result two linears read: no single row-parallel partner."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(16, 8)
        self.o_proj, self.gate = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        q = self.q_proj(x).view(*x.shape[:-1], 4, 4).flatten(-2)
        h = q + torch.cat([self.k_proj(x), self.v_proj(x)], dim=-1)
        return self.o_proj(h) + self.gate(h)


def test_unprovable_partner_is_refused():
    import fxrewrite

    model = fxrewrite.optimize(_TwoReaders(), example_inputs=((torch.randn(2, 16),), {}))
    assert model.qkv_proj.row_partner is None
    with pytest.raises(ValueError, match=r"reach 2 linears \(o_proj, gate\), not one child nn.Linear"):
        shard_model(model, tp_rank=0, tp_size=2)


def test_sliced_loading_reads_only_the_rank_slice(tmp_path):
    full = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
    save_file({"w": full}, str(tmp_path / "model.safetensors"))
    ((name, lazy),) = list(iterate_safetensors(tmp_path, sliced=True))
    assert isinstance(lazy, LazySlice) and lazy.shape == (6, 8)
    row = RowParallelLinear(8, 6, tp_size=2, tp_rank=1)
    merged = MergedColumnParallelLinear(8, [3, 3], tp_size=3, tp_rank=2)
    for name, lazy in iterate_safetensors(tmp_path, sliced=True):
        row.weight.weight_loader(row.weight, lazy)
        merged.weight.weight_loader(merged.weight, lazy)
    torch.testing.assert_close(row.weight.data, full[:, 4:])
    torch.testing.assert_close(merged.weight.data, full[[2, 5]])


def test_unfused_model_follows_base_model_tp_plan():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fxrewrite.layers.linear import ColumnParallelLinear

    config = Qwen3Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = Qwen3ForCausalLM(config)  # not optimized: nothing fused, the config's plan decides
    plan = shard_model(model, tp_rank=0, tp_size=2)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert {plan[f"model.layers.0.self_attn.{n}"] for n in ("q_proj", "k_proj", "v_proj")} == {"colwise"}
    assert plan["model.layers.0.self_attn.o_proj"] == plan["model.layers.0.mlp.down_proj"] == "rowwise"
    assert isinstance(attn.k_proj, ColumnParallelLinear) and attn.k_proj.weight.shape == (8, 32)
    assert isinstance(mlp.down_proj, RowParallelLinear) and mlp.down_proj.weight.shape == (32, 32)
    assert "model.layers.0.self_attn.q_norm" not in plan  # per-head norm: replicated

    config.num_key_value_heads = 1  # one kv head cannot be split column-wise without the fusion
    with pytest.raises(ValueError, match="1 heads over tp_size=2"):
        shard_model(Qwen3ForCausalLM(config), tp_rank=0, tp_size=2)


def test_unfused_olmoe_attention_is_head_sharded():
    """fusion=False: transformers' OLMoE plan gathers q/k/v for its full-width norms; fxrewrite shards heads
    instead (the KV cache holds this rank's kv heads) and the norms become ShardedRMSNorm slices."""
    from fxrewrite.layers.sharded_norm import ShardedRMSNorm
    from tests.moe.conftest import tiny_moe

    model = tiny_moe("olmoe")
    full = {k: v.clone() for k, v in model.state_dict().items()}
    plan = shard_model(model, tp_rank=1, tp_size=2)
    attn = model.model.layers[0].self_attn
    assert plan["model.layers.0.self_attn.k_proj"] == "colwise" and plan["model.layers.0.self_attn.o_proj"] == "rowwise"
    assert attn.k_proj.weight.shape[0] == full["model.layers.0.self_attn.k_proj.weight"].shape[0] // 2
    assert isinstance(attn.q_norm, ShardedRMSNorm) and plan["model.layers.0.self_attn.q_norm"] == "norm_sharded"
    width = attn.k_norm.local_size
    assert torch.equal(attn.k_norm.weight, full["model.layers.0.self_attn.k_norm.weight"][width:])


def test_mla_latent_norm_is_not_taken_for_a_full_width_k_norm():
    """DeepSeek with q_lora_rank=None has a column-wise q_proj and a kv_a_layernorm whose width (kv_lora_rank 32)
    equals 4 heads x head_dim 8: it normalises the replicated latent, not keys, so it stays whole (it was
    replaced by a ShardedRMSNorm slice and TP=2 crashed)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
                              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    model = DeepseekV3ForCausalLM(config)
    plan = shard_model(model, tp_rank=0, tp_size=2)
    attn = model.model.layers[0].self_attn
    if any("self_attn" in k for k in config.base_model_tp_plan or {}):  # transformers 5.17 has no MLA tp plan
        assert plan["model.layers.0.self_attn.q_proj"] == "colwise"
    assert "model.layers.0.self_attn.kv_a_layernorm" not in plan and attn.kv_a_layernorm.weight.shape == (32,)


@pytest.mark.parametrize("impl", ["eager", "batched_mm", "grouped_mm"])
@pytest.mark.parametrize("family", ["gpt_oss", "olmoe", "qwen2_moe"])
def test_unfused_transformers_experts_split_whole_over_ranks(family, impl):
    """transformers' own experts modules (GPT-OSS's, which the moe pattern does not fuse; any with fusion off): rank r
    of 2 holds experts [r*E/2, (r+1)*E/2) of every parameter (interleaved gate/up and biases included), and the two
    ranks' outputs sum to the whole module's (the all-reduce the forward hook runs, done here by hand). Through each
    experts implementation transformers dispatches to (their names for the inputs differ from the module's)."""
    import copy

    from fxrewrite.runtime.worker.weight_sync import full_shape, plan_update
    from tests.moe.conftest import tiny_moe

    if family == "gpt_oss":
        from transformers import AutoModelForCausalLM, GptOssConfig

        torch.manual_seed(0)
        config = GptOssConfig(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                              num_experts_per_tok=2, initializer_range=0.2)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    else:
        model = tiny_moe(family)
    model.config._experts_implementation = impl
    experts = model.model.layers[0].mlp.experts
    params = {k: v.detach().clone() for k, v in experts.named_parameters()}
    num_experts = experts.num_experts
    x = torch.randn(6, 32)
    ids = torch.stack([torch.randperm(num_experts)[:2] for _ in range(6)])  # distinct experts per token
    weights = torch.rand(6, 2)
    with torch.no_grad():
        want = experts(x, ids, weights)
    parts = []
    for rank in (0, 1):
        shard = copy.deepcopy(model)
        plan = shard_model(shard, tp_rank=rank, tp_size=2)
        local = shard.model.layers[0].mlp.experts
        assert plan["model.layers.0.mlp.experts"] == "experts_whole" and local.num_experts == num_experts // 2
        half = num_experts // 2
        for name, param in local.named_parameters():
            assert torch.equal(param, params[name][rank * half:(rank + 1) * half]), name
            assert full_shape(local, param, None) == tuple(params[name].shape)  # what weight sync sends: all E
        plan_update(shard, [(n, tuple(p.shape)) for n, p in model.named_parameters()])  # full tensors accepted
        with torch.no_grad():
            parts.append(local(x, ids, weights))
    torch.testing.assert_close(parts[0] + parts[1], want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(parts[0], want)  # each rank computes only its experts' share


def test_unfused_experts_loader_reads_its_rows_and_names_a_wrong_shape():
    from tests.moe.conftest import tiny_moe

    model = tiny_moe("olmoe")
    full = model.model.layers[0].mlp.experts.down_proj.detach().clone()  # [8, 32, 16]
    shard_model(model, tp_rank=1, tp_size=2)
    param = model.model.layers[0].mlp.experts.down_proj
    param.weight_loader(param, LazySlice(_FakeSliceable(full), tuple(full.shape)))
    assert torch.equal(param, full[4:])
    with pytest.raises(ValueError, match=r"experts weight shape \(6, 32, 16\) does not match \(8, 32, 16\)"):
        param.weight_loader(param, full[:6])


class _FakeSliceable:
    """A safetensors slice handle over a tensor (indexing by a tuple of slices)."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __getitem__(self, index):
        return self.tensor[index].clone()


def test_a_plan_splitting_a_bare_parameter_is_refused():
    """Beam's plan splits each attention's per-head `gate_bias` column-wise; only linear layers are sharded here, so a
    whole parameter would meet half the heads on each rank (a shape error in the load check's step before)."""
    from fxrewrite.errors import UnsupportedModelError

    model = _optimized_qwen3(2)
    attn = model.model.layers[0].self_attn
    attn.register_parameter("sinks", nn.Parameter(torch.zeros(4)))  # narrowed by the paged attention: no refusal
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, "layers.*.self_attn.sinks": "colwise"}
    shard_model(model, tp_rank=0, tp_size=2)
    model = _optimized_qwen3(2)
    attn = model.model.layers[0].self_attn
    attn.register_parameter("gate_bias", nn.Parameter(torch.zeros(4)))
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, "layers.*.self_attn.gate_bias": "colwise"}
    with pytest.raises(UnsupportedModelError, match=r"splits the parameter layers.0.self_attn.gate_bias \('colwise'\)"):
        shard_model(model, tp_rank=0, tp_size=2)
