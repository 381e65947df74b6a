"""qk_norm_rope pattern: Qwen3's per-head q/k RMSNorm + rotary fused into one call; near misses refused."""

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as hf_apply

import fxrewrite
from fxrewrite.layers.kv_context import set_kv_step, take_kv_written
from fxrewrite.layers.layernorm import RMSNorm
from fxrewrite.patterns.base import Match, Refusal
from fxrewrite.patterns.qk_norm_rope import QKNormRopePattern, QKNormRotaryEmb
from fxrewrite.patterns.rotary import apply_rotary_qk
from fxrewrite.weights import load_hf_weights
from tests.e2e.tiny_models import tiny_model
from tests.kernels.conftest import interpret  # noqa: F401  (the Triton-interpreter fixture)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _ids(shape, seed):
    return torch.randint(3, 96, shape, generator=torch.Generator().manual_seed(seed))


def _cos_sin(seq, rotary_dim, seed=0):
    angles = torch.rand(1, seq, rotary_dim // 2, generator=torch.Generator().manual_seed(seed)) * 6
    return torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)


def _hf_norm(dim, eps=1e-6, seed=0):
    norm = Qwen3RMSNorm(dim, eps)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim, generator=torch.Generator().manual_seed(seed)) + 0.5)
    return norm


def _fused_norm(hf):
    norm = RMSNorm(hf.weight.shape[0], hf.variance_epsilon)
    norm.weight.data.copy_(hf.weight.data)
    return norm


@pytest.fixture(scope="module")
def qwen3_pair():
    stock = tiny_model("qwen3")
    return stock, fxrewrite.optimize(copy.deepcopy(stock))


def test_qwen3_fused_in_place_and_logits_match(qwen3_pair):
    stock, fused = qwen3_pair
    report = fxrewrite.explain(fused)
    assert "qk_norm_rope" in report.applied_patterns() and "rotary_apply" not in report.applied_patterns()
    assert report.skipped() == []
    attn = fused.model.layers[0].self_attn
    assert isinstance(attn.qk_norm_rope, QKNormRotaryEmb) and attn.qk_norm_rope.inplace
    assert isinstance(attn.q_norm, RMSNorm)
    call = ("self.qk_norm_rope(query_states, key_states, cos, sin, q_norm=self.q_norm, k_norm=self.k_norm, "
            "value=value_states)")
    assert call in report.diff()
    with torch.no_grad():
        ids = _ids((2, 9), 1)
        assert _rel(fused(ids).logits, stock(ids).logits) < 1e-5
        ids, pos = _ids((1, 6), 2), torch.tensor([[3, 4, 5, 60, 61, 62]])
        assert _rel(fused(ids, position_ids=pos).logits, stock(ids, position_ids=pos).logits) < 1e-5


def test_hf_checkpoint_loads_norm_weights_by_name(qwen3_pair):
    stock, _ = qwen3_pair
    fresh = fxrewrite.optimize(tiny_model("qwen3", seed=1))
    assert set(fresh.state_dict()) == set(stock.state_dict())  # HF names, q_norm/k_norm included
    loaded = load_hf_weights(fresh, stock.state_dict().items())
    assert "model.layers.1.self_attn.k_norm.weight" in loaded and set(dict(fresh.named_parameters())) <= loaded
    ids = _ids((1, 7), 7)
    with torch.no_grad():
        assert _rel(fresh(ids).logits, stock(ids).logits) < 1e-5


def test_torch_form_is_transformers_bit_for_bit():
    """Norm then rotate on the transposed [B, H, S, D] views: the same bits as Qwen3Attention's order."""
    torch.manual_seed(0)
    seq, heads, kv_heads, dim = 5, 4, 2, 16
    hf_q, hf_k = _hf_norm(dim, seed=1), _hf_norm(dim, seed=2)
    q = torch.randn(1, seq, heads * dim).view(1, seq, heads, dim)
    k = torch.randn(1, seq, kv_heads * dim).view(1, seq, kv_heads, dim)
    for rotary_dim in (dim, dim // 2):
        cos, sin = _cos_sin(seq, rotary_dim)
        if rotary_dim == dim:
            want = hf_apply(hf_q(q).transpose(1, 2), hf_k(k).transpose(1, 2), cos, sin)
        else:
            want = apply_rotary_qk(hf_q(q).transpose(1, 2), hf_k(k).transpose(1, 2), cos, sin)
        got = QKNormRotaryEmb()(q.transpose(1, 2), k.transpose(1, 2), cos, sin,
                                q_norm=_fused_norm(hf_q), k_norm=_fused_norm(hf_k))
        assert len(got) == len(want) == 2  # (q, k)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("rotary_dim", [16, 8])
@pytest.mark.parametrize("inplace", [True, False])
def test_kernel_path_matches_torch_form(interpret, monkeypatch, rotary_dim, inplace):
    """No grad, one batch row: the Triton kernel (interpreted) gives the torch form's result, writes q
    and k in place only when allowed, and stays off while autograd records."""
    torch.manual_seed(0)
    seq, dim = 6, 16
    qkv = torch.randn(1, seq, (4 + 2 + 2) * dim)  # a fused projection's output, split like QKVPattern's
    q, k, _ = qkv.split([4 * dim, 2 * dim, 2 * dim], dim=-1)
    q, k = q.view(1, seq, 4, dim).transpose(1, 2), k.view(1, seq, 2, dim).transpose(1, 2)
    q0, k0 = q.clone(), k.clone()
    norms = dict(q_norm=_fused_norm(_hf_norm(dim, seed=1)), k_norm=_fused_norm(_hf_norm(dim, seed=2)))
    cos, sin = _cos_sin(seq, rotary_dim)
    op = QKNormRotaryEmb(inplace)
    with torch.no_grad():
        want = apply_rotary_qk(norms["q_norm"](q0), norms["k_norm"](k0), cos, sin)  # the torch form
        assert not op._kernel_applies(q, k, cos, 1, **norms)  # CPU tensors: torch unless forced
        monkeypatch.setenv("FXREWRITE_TRITON", "1")
        assert op._kernel_applies(q, k, cos, 1, **norms)
        got = op(q, k, cos, sin, **norms)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert (got[0].data_ptr() == q.data_ptr()) == inplace
    assert torch.equal(q, q0) != inplace and torch.equal(k, k0) != inplace
    norms["q_norm"].weight.requires_grad_(True)
    assert not op._kernel_applies(q, k, cos, 1, **norms)


def test_llama_unaffected():
    fused = fxrewrite.optimize(tiny_model("llama"))
    report = fxrewrite.explain(fused)
    assert "rotary_apply" in report.applied_patterns() and "qk_norm_rope" not in report.applied_patterns()
    assert report.skipped() == []


def _with_norms(make, layers=(0, 1)):
    model = tiny_model("qwen3")
    for i in layers:
        attn = model.model.layers[i].self_attn
        attn.q_norm, attn.k_norm = make(attn.head_dim), make(attn.head_dim)
    return model


def test_norm_that_is_not_rmsnorm_refused_rotary_still_fused():
    stock = _with_norms(nn.LayerNorm)
    fused = fxrewrite.optimize(copy.deepcopy(stock))
    report = fxrewrite.explain(fused)
    assert "qk_norm_rope" not in report.applied_patterns() and "rotary_apply" in report.applied_patterns()
    assert ("Qwen3Attention", "qk_norm_rope", "q_norm is LayerNorm, not a fused RMSNorm (rms_norm did not prove it)") \
        in report.skipped()
    assert isinstance(fused.model.layers[0].self_attn.q_norm, nn.LayerNorm)
    ids = _ids((2, 8), 4)
    with torch.no_grad():
        assert _rel(fused(ids).logits, stock(ids).logits) < 1e-5


def test_instance_with_other_norm_keeps_its_rotary_call():
    """Layer 1's norms are torch's own RMSNorm: that instance is refused (per instance), layer 0 fused."""
    stock = _with_norms(lambda d: nn.RMSNorm(d, eps=1e-6), layers=(1,))
    fused = fxrewrite.optimize(copy.deepcopy(stock))
    report = fxrewrite.explain(fused)
    assert report.classes["Qwen3Attention"].applied["qk_norm_rope"] == {
        "q_norm,k_norm + apply_rotary_pos_emb -> qk_norm_rope (in place, + K/V cache write)": 1}
    # layer 1 has other child classes: traced and judged on its own (its rotary call is fused alone)
    assert ("Qwen3Attention", "qk_norm_rope", "[model.layers.1.self_attn] q_norm is RMSNorm, not a fused RMSNorm "
            "(rms_norm did not prove it)") in report.skipped()
    assert report.classes["Qwen3Attention"].applied["rotary_apply"] == {"apply_rotary_pos_emb -> apply_rotary_emb": 1}
    assert hasattr(fused.model.layers[0].self_attn, "qk_norm_rope")
    assert not hasattr(fused.model.layers[1].self_attn, "qk_norm_rope")
    ids = _ids((1, 8), 5)
    with torch.no_grad():
        assert _rel(fused(ids).logits, stock(ids).logits) < 1e-5


def test_validate_refuses_norm_weight_not_head_sized():
    match = Match(QKNormRopePattern, frozenset(), (("fn", "apply_rotary_pos_emb"), ("q_norm", "q_norm"),
                                                   ("k_norm", "k_norm")), (("head_size", 8), ("inplace", True)))
    module = nn.Module()
    module.q_norm, module.k_norm = RMSNorm(16), RMSNorm(8)
    with pytest.raises(Refusal, match="q_norm weight has 16 elements, expected head_dim 8 on this instance"):
        QKNormRopePattern.validate(match, module, None)
    module.q_norm = RMSNorm(8, offset=1.0)
    with pytest.raises(Refusal, match="not the Llama form"):
        QKNormRopePattern.validate(match, module, None)


# --- HF-shaped attention modules (module-level function: the tracer keeps it as one leaf call) ---

def apply_rotary_pos_emb(q, k, cos, sin):
    return apply_rotary_qk(q, k, cos, sin)


class Attn(nn.Module):
    def __init__(self, hidden=16, heads=2, dim=8):
        super().__init__()
        self.head_dim = dim
        self.q_proj, self.k_proj = nn.Linear(hidden, heads * dim), nn.Linear(hidden, heads * dim)
        self.q_norm, self.k_norm = _hf_norm(dim, seed=1), _hf_norm(dim, seed=2)

    def forward(self, x, cos, sin):
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q + k


class NamedProjectionAttn(Attn):
    def forward(self, x, cos, sin):
        shape = (*x.shape[:-1], -1, self.head_dim)
        qp = self.q_proj(x)  # named: the source cannot prove nobody else reads it, so the kernel copies
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        q, k = apply_rotary_pos_emb(self.q_norm(qp.view(shape)).transpose(1, 2), k, cos, sin)
        return q + k


class ReadBetweenAttn(Attn):
    def forward(self, x, cos, sin):
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        if self.training:  # not taken when traced: the graph cannot see this read of the normalised q
            self.q_mean = q.mean()
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q + k


def _run(module):
    torch.manual_seed(0)
    x = torch.randn(1, 5, 16)
    cos, sin = _cos_sin(5, 8, seed=3)
    module.eval()
    with torch.no_grad():
        ref = module(x, cos, sin)
        fxrewrite.optimize(module, example_inputs=((x, cos, sin), {}))
        return fxrewrite.explain(module), ref, module(x, cos, sin)


def test_hf_shaped_modules():
    report, ref, out = _run(module := Attn())
    assert report.applied_patterns() == ["qk_norm_rope", "rms_norm"] and module.qk_norm_rope.inplace
    assert torch.equal(out, ref)
    report, ref, out = _run(module := NamedProjectionAttn())
    assert report.applied_patterns() == ["qk_norm_rope", "rms_norm"] and not module.qk_norm_rope.inplace
    assert "(on a copy)" in str(report) and torch.equal(out, ref)


def test_read_between_norm_and_rotary_refused():
    report, ref, out = _run(module := ReadBetweenAttn())
    assert "qk_norm_rope" not in report.applied_patterns() and not hasattr(module, "qk_norm_rope")
    assert ("ReadBetweenAttn", "qk_norm_rope", "'q' is used between the norm and rotary") in report.skipped()
    assert torch.equal(out, ref)


def test_qwen3_engine_shape_through_kernels(interpret, monkeypatch, qwen3_pair):
    """One batch row, no grad, every fused layer on its Triton kernel (interpreted): logits still match."""
    stock, fused = qwen3_pair
    ids, pos = _ids((1, 5), 6), torch.tensor([[0, 1, 2, 9, 10]])
    calls = []
    kernel = QKNormRotaryEmb._kernel
    monkeypatch.setattr(QKNormRotaryEmb, "_kernel", lambda self, *a: calls.append(1) or kernel(self, *a))
    with torch.no_grad():
        want = stock(ids, position_ids=pos).logits
        monkeypatch.setenv("FXREWRITE_TRITON", "1")
        got = fused(ids, position_ids=pos).logits
    assert len(calls) == 2 and _rel(got, want) < 1e-5


class ValueAttn(Attn):
    """HF-shaped: q/k norms, rotary, then transformers' attention function on (self, q, k, v)."""

    def __init__(self):
        super().__init__()
        self.v_proj, self.layer_idx = nn.Linear(16, 16), 3

    def forward(self, x, cos, sin):
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)(self, q, k, v, None)[0]


class ValueReadAgainAttn(ValueAttn):
    def forward(self, x, cos, sin):
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)(self, q, k, v, None)[0]
        return out + v.transpose(1, 2)  # the values have another reader


class ValueAfterRotaryAttn(ValueAttn):
    def forward(self, x, cos, sin):
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        v = self.v_proj(x).view(shape).transpose(1, 2)  # not yet bound where the rotary call is
        return ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)(self, q, k, v, None)[0]


def test_value_passed_only_when_the_attention_alone_reads_it():
    report, ref, out = _run(module := ValueAttn())
    assert report.classes["ValueAttn"].applied["qk_norm_rope"] == {
        "q_norm,k_norm + apply_rotary_pos_emb -> qk_norm_rope (in place, + K/V cache write)": 1}
    assert "k_norm=self.k_norm, value=v)" in report.diff() and module.qk_norm_rope.layer_idx == 3
    assert _rel(out, ref) < 1e-6  # SDPA on other strides: not bit for bit
    for cls in (ValueReadAgainAttn, ValueAfterRotaryAttn):
        report, ref, out = _run(module := cls())
        assert report.classes[cls.__name__].applied["qk_norm_rope"] == {
            "q_norm,k_norm + apply_rotary_pos_emb -> qk_norm_rope (in place)": 1}, cls
        assert module.qk_norm_rope.layer_idx is None and _rel(out, ref) < 1e-6


def test_kernel_writes_k_and_v_into_the_engine_step_cache(interpret, monkeypatch):
    """In an engine step (`kv_context`) the norm-rope kernel also writes the rotated k and v at the step's slots
    of its layer's cache (negative slots skipped) and notes them once; outside a step it writes nothing."""
    monkeypatch.setenv("FXREWRITE_TRITON", "1")
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, heads, 5, 8, generator=gen) for heads in (4, 2, 2))
    cos, sin = _cos_sin(5, 8, seed=4)
    norms = {"q_norm": _fused_norm(_hf_norm(8, seed=1)), "k_norm": _fused_norm(_hf_norm(8, seed=2))}
    caches = [(torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)) for _ in range(2)]
    slots = torch.tensor([5, 2, -1, 11, 0])
    op = QKNormRotaryEmb(inplace=False, layer_idx=1)
    with torch.no_grad():
        want_q, want_k = op(q, k, cos, sin, value=v, **norms)  # no step: nothing written or noted
        assert not any(c.any() for pair in caches for c in pair) and not take_kv_written(1, want_k, v)
        set_kv_step(SimpleNamespace(kv_caches=caches, slot_mapping=slots))
        try:
            got_q, got_k = op(q, k, cos, sin, value=v, **norms)
            assert take_kv_written(1, got_k, v) and not take_kv_written(1, got_k, v)  # one note, for these tensors
        finally:
            set_kv_step(None)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    key_cache, value_cache = (c.view(12, 2, 8) for c in caches[1])
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(key_cache[slot], got_k[0, :, token]) and torch.equal(value_cache[slot], v[0, :, token])
    written = slots[slots >= 0]
    assert key_cache[written].abs().sum() > 0 and not caches[0][0].any() and not caches[0][1].any()
    assert int((key_cache.abs().sum((1, 2)) > 0).sum()) == written.numel()
