"""Row partners are proven head by head (feature by feature): an operation between a fused layer's outputs and its
row partner that mixes heads leaves the partner unproven, and sharding refuses the model with the reason; the same
models stay exact at tensor_parallel_size 1."""

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP

import fxrewrite
from fxrewrite.errors import UnsupportedModelError
from fxrewrite.sharding import shard_model

from tests.compiler.custom_attention import ImportingAttention, custom_llama

GATES = dict(head_gate=torch.randn(4, 1, generator=torch.Generator().manual_seed(1)),
             dim_gate=torch.randn(8, generator=torch.Generator().manual_seed(2)),
             feature_scale=torch.randn(48, generator=torch.Generator().manual_seed(3)))


class FlipAttention(ImportingAttention):
    def merge_heads(self, attn_output, input_shape):
        return attn_output.reshape(*input_shape, -1).flip(-1)  # reverses the heads' order


class DimMajorAttention(ImportingAttention):
    def merge_heads(self, attn_output, input_shape):
        return attn_output.transpose(-1, -2).reshape(*input_shape, -1)  # dim-major: a rank's slice mixes heads


class HeadGateAttention(ImportingAttention):
    def merge_heads(self, attn_output, input_shape):
        return (attn_output * self.head_gate * 0.5).reshape(*input_shape, -1)  # [H, 1]: one gate per head


class TransposedFlipAttention(ImportingAttention):
    def merge_heads(self, attn_output, input_shape):  # attributes are values too (a final fresh user's case)
        return (attn_output + 3.0 * attn_output.mT.flip(-2).mT + attn_output.data).reshape(*input_shape, -1)


class WidthScaledAttention(ImportingAttention):
    def merge_heads(self, attn_output, input_shape):
        merged = attn_output.reshape(*input_shape, -1)
        return merged * merged.shape[-1] ** -0.5  # the width: all heads' at one rank, a share at another


class DimScaledAttention(ImportingAttention):
    def merge_heads(self, attn_output, input_shape):
        return (attn_output * attn_output.shape[-1] ** -0.5).reshape(*input_shape, -1)  # head_dim: every rank's


class ElementwiseAttention(ImportingAttention):
    def merge_heads(self, attn_output, input_shape):  # elementwise ops with numbers: per head
        o = torch.relu(attn_output).clamp(min=-1.0, max=2.0) ** 2 + attn_output.abs() + torch.nan_to_num(attn_output)
        return o.reshape(*input_shape, -1)


class HeadClampAttention(ImportingAttention):
    def merge_heads(self, attn_output, input_shape):
        return attn_output.clamp(max=self.head_gate).reshape(*input_shape, -1)  # a bound per head


class DimGateAttention(ImportingAttention):
    def merge_heads(self, attn_output, input_shape):
        return (attn_output * self.dim_gate * 0.5).reshape(*input_shape, -1).contiguous()  # [D]: alike in every head


class FeatureScaledMLP(LlamaMLP):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * self.feature_scale)


class HalvedMLP(LlamaMLP):
    def forward(self, x):
        return self.down_proj(nn.functional.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 0.5, 0.0))


def _optimized_matches_stock(model):
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(ids).logits
        optimized = fxrewrite.optimize(model)
        torch.testing.assert_close(optimized(ids).logits, want, rtol=1e-5, atol=1e-5)
    return optimized


@pytest.mark.parametrize("attention, why", [(FlipAttention, "flip"), (DimMajorAttention, "reshapes"),
                                            (HeadGateAttention, "varies across heads"), (TransposedFlipAttention, "flip"),
                                            (WidthScaledAttention, "reads the size"),
                                            (HeadClampAttention, "varies across heads")])
def test_attention_output_mixing_heads_is_not_sharded(attention, why):
    model = _optimized_matches_stock(custom_llama(attention=attention, num_hidden_layers=1, **GATES))
    qkv = model.model.layers[0].self_attn.qkv_proj  # fused all the same: exact at one rank
    assert qkv.row_partner is None and why in qkv.row_partner_why and "o_proj" in qkv.row_partner_why
    with pytest.raises(UnsupportedModelError, match=f"self_attn.qkv_proj.*no proven row partner.*{why}"):
        shard_model(model, tp_rank=0, tp_size=2)


@pytest.mark.parametrize("attention", [DimGateAttention, DimScaledAttention, ElementwiseAttention])
def test_per_head_operations_keep_the_partner(attention):
    model = _optimized_matches_stock(custom_llama(attention=attention, mlp=HalvedMLP, num_hidden_layers=1, **GATES))
    layer = model.model.layers[0]
    assert (layer.self_attn.qkv_proj.row_partner, layer.mlp.gate_up_proj.row_partner) == ("o_proj", "down_proj")
    plan = shard_model(model, tp_rank=1, tp_size=2)
    assert plan["model.layers.0.self_attn.o_proj"] == plan["model.layers.0.mlp.down_proj"] == "rowwise"


class WidthScaledMLP(LlamaMLP):
    def forward(self, x):
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(h * h.shape[-1] ** 0.5)  # a muP-style width scale: each rank would use its share's


@pytest.mark.parametrize("mlp, why", [(FeatureScaledMLP, "varies across heads"), (WidthScaledMLP, "reads the size")])
def test_a_per_feature_scale_in_the_gated_product_is_not_sharded(mlp, why):
    model = _optimized_matches_stock(custom_llama(mlp=mlp, num_hidden_layers=1, **GATES))
    gate_up = model.model.layers[0].mlp.gate_up_proj
    assert gate_up.row_partner is None and why in gate_up.row_partner_why
    with pytest.raises(UnsupportedModelError, match="mlp.gate_up_proj.*no proven row partner"):
        shard_model(model, tp_rank=0, tp_size=2)
