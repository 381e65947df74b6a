"""optimize() on tiny Llama/Qwen2/Qwen3/Mistral/Gemma2/Phi3: logits, greedy generation, grads, report."""

import copy

import pytest
import torch
from tests.e2e.tiny_models import ARCHS, tiny_model

import fxrewrite
from fxrewrite.weights import to_hf_names

FULL = ["glu", "input_norm", "lm_head_loss", "qkv", "residual_rms_norm", "rms_norm", "rotary", "rotary_apply"]
EXPECTED_APPLIED = {arch: FULL for arch in ARCHS}
# its pre-fused qkv_proj / gate_up_proj are proven and recorded for sharding; the input norm stays a call (the QKV
# fold that proves the attention's input is read by q/k/v alone is the split-linear one)
EXPECTED_APPLIED["phi3"] = [p for p in FULL if p != "input_norm"]
# Qwen3's per-head q/k norms: its rotary call is fused with them (qk_norm_rope), not alone (rotary_apply)
EXPECTED_APPLIED["qwen3"] = ["glu", "input_norm", "lm_head_loss", "qk_norm_rope", "qkv", "residual_rms_norm", "rms_norm",
                             "rotary"]
EXPECTED_PRESENT = {arch: [] for arch in ARCHS}  # Phi-3 ships qkv_proj / gate_up_proj fused: applied, proven


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request):
    stock = tiny_model(request.param)
    fused = fxrewrite.optimize(copy.deepcopy(stock))
    return request.param, stock, fused


def test_report_lists_patterns(pair):
    arch, _, fused = pair
    report = fxrewrite.explain(fused)
    assert report.applied_patterns() == EXPECTED_APPLIED[arch]
    assert report.present_patterns() == EXPECTED_PRESENT[arch]
    assert report.skipped() == []
    diff = report.diff()
    fused_call = "self.qk_norm_rope(" if arch == "qwen3" else "self.apply_rotary_emb("
    assert "+    query_states, key_states = " + fused_call in diff
    assert ("self.qkv_proj(hidden_states).split(" in diff) == (arch != "phi3")
    assert ("qkv.split(self.qkv_output_sizes, dim=-1)" in diff) == (arch == "phi3")


def test_logits_match(pair):
    _, stock, fused = pair
    ids = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert _rel(fused(ids).logits, stock(ids).logits) < 1e-5


def test_flattened_batch_one_with_arbitrary_positions(pair):
    _, stock, fused = pair
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    pos = torch.tensor([[5, 6, 7, 40, 41, 42]])
    with torch.no_grad():
        assert _rel(fused(ids, position_ids=pos).logits, stock(ids, position_ids=pos).logits) < 1e-5


def test_greedy_generation_identical(pair):
    _, stock, fused = pair
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(fused.generate(ids, **kwargs), stock.generate(ids, **kwargs))


def test_grads_match_in_hf_names(pair):
    _, stock, fused = pair
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(4))
    grads = {}
    for model in (stock, fused):
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        grads[model is fused] = {n: p.grad for n, p in model.named_parameters()}
    hf = to_hf_names(fused, grads[True])
    assert set(hf) == set(grads[False])
    for name, g in grads[False].items():
        assert _rel(hf[name], g) < 1e-4, name


def test_optimize_twice_is_noop(pair):
    _, _, fused = pair
    before = {n: id(m) for n, m in fused.named_modules()}
    assert fxrewrite.optimize(fused) is fused
    assert before == {n: id(m) for n, m in fused.named_modules()}


def test_training_step():
    model = fxrewrite.optimize(tiny_model("llama"))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(5))
    first = model(ids, labels=ids).loss
    first.backward()
    opt.step()
    opt.zero_grad()
    assert model(ids, labels=ids).loss < first


def test_class_and_other_instances_untouched():
    stock = tiny_model("llama")
    fused = fxrewrite.optimize(tiny_model("llama"))
    attn_cls = type(stock.model.layers[0].self_attn)
    assert "forward" not in vars(stock.model.layers[0].self_attn)
    assert "forward" in vars(fused.model.layers[0].self_attn)
    assert attn_cls.forward is type(fused.model.layers[0].self_attn).forward
    assert hasattr(stock.model.layers[0].self_attn, "q_proj")


def test_torch_compile_matches_eager():
    fused = fxrewrite.optimize(tiny_model("qwen3"))
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(6))
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, fused(ids).logits, rtol=1e-5, atol=1e-5)
