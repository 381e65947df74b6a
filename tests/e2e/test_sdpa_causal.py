"""``fxrewrite_sdpa``: under torch.compile an unpadded, unpacked training call attends with SDPA's implicit causal mask
(no [B, 1, S, S] mask, no k/v copies), as eager transformers does; padded or packed calls keep their mask, and every
loss equals stock transformers' (float32, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from tests.e2e.tiny_models import tiny_model

import fxrewrite
from fxrewrite.layers.sdpa_causal import SDPA_CAUSAL

_SDPA = torch._C._nn.scaled_dot_product_attention


def _compiled_sdpa_masks(model, **inputs) -> tuple[float, list]:
    """Loss of a compiled call and the attn_mask argument of every SDPA node in the traced graphs."""
    masks = []

    def backend(gm, example_inputs):
        masks.extend(n.kwargs.get("attn_mask") for n in gm.graph.nodes if n.target is _SDPA)
        return gm

    torch._dynamo.reset()
    loss = torch.compile(model, backend=backend)(**inputs).loss
    return float(loss), masks


def _pair(arch="qwen3"):
    stock = tiny_model(arch, num_hidden_layers=2, use_cache=False).train()
    fused = fxrewrite.optimize(tiny_model(arch, num_hidden_layers=2, use_cache=False).train()).train()
    return stock, fused


def test_unpadded_call_has_no_mask_under_compile():
    stock, fused = _pair()
    assert fused.config._attn_implementation == SDPA_CAUSAL
    assert any(SDPA_CAUSAL in n for n in fxrewrite.explain(fused).notes)
    ids = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    loss, masks = _compiled_sdpa_masks(fused, input_ids=ids, labels=ids)
    assert masks and all(m is None for m in masks), masks
    assert abs(loss - float(stock(input_ids=ids, labels=ids).loss)) <= 1e-5 * abs(loss)


@pytest.mark.parametrize("case", ["packed", "padded"])
def test_packed_or_padded_call_keeps_its_mask(case):
    stock, fused = _pair()
    ids = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    if case == "packed":  # two sequences per row (position ids restart): not causal over the whole row
        extra = {"position_ids": torch.cat([torch.arange(5), torch.arange(6)]).expand(2, -1)}
    else:
        mask = torch.ones(2, 11, dtype=torch.long)
        mask[1, :4] = 0
        extra = {"attention_mask": mask}
    loss, masks = _compiled_sdpa_masks(fused, input_ids=ids, labels=ids, **extra)
    assert masks and all(m is not None for m in masks)
    assert abs(loss - float(stock(input_ids=ids, labels=ids, **extra).loss)) <= 1e-5 * abs(loss)


def test_switch_off_and_saved_config(tmp_path, monkeypatch):
    _, fused = _pair()
    monkeypatch.setenv("FXREWRITE_COMPILE_CAUSAL_SKIP", "0")
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(2))
    _, masks = _compiled_sdpa_masks(fused, input_ids=ids, labels=ids)
    assert masks and all(m is not None for m in masks)  # transformers' own choice while compiling
    fused.config.save_pretrained(tmp_path)
    assert SDPA_CAUSAL not in json.loads((tmp_path / "config.json").read_text()).values()


def test_sdpa_registered_anew_is_kept(monkeypatch):
    """A user's function registered as "sdpa" in transformers' attention registry stays what the model runs."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def doubled(module, *args, **kwargs):
        out, weights = sdpa_attention_forward(module, *args, **kwargs)
        return out * 2.0, weights

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", doubled)
    model = tiny_model("qwen3", num_hidden_layers=2)
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
    fxrewrite.optimize(model)
    assert model.config._attn_implementation == "sdpa" and not fxrewrite.explain(model).notes
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
