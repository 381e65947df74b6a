"""The per-structure trace / match cache (issue 12, optimize time): identical layers are traced and matched
once, and two layers that differ in anything the match depends on are each traced and judged on their own,
with a report line naming the module and the reason."""

import collections
import copy
import weakref

import pytest
import torch
from torch import nn

import fxrewrite
from fxrewrite import compiler, signature, tracer
from fxrewrite.meta_memo import MetaMemo
from fxrewrite.weights import to_hf_names

from tests.e2e.tiny_models import tiny_model


@pytest.fixture
def traces(monkeypatch):
    """Counter of `tracer.trace` calls by class name during optimize."""
    counts = collections.Counter()
    real = tracer.trace

    def counting(module, *args, **kwargs):
        counts[type(module).__name__] += 1
        return real(module, *args, **kwargs)

    monkeypatch.setattr(compiler.tracer, "trace", counting)
    return counts


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_identical_layers_share_one_trace_and_one_meta_run(traces):
    model = tiny_model("qwen3", num_hidden_layers=4)
    layers = model.model.layers
    assert len({signature.structure_key(layer) for layer in layers}) == 1  # layer_idx differs, is a cache index
    keys = signature.structure_keys(model)  # the one-pass version agrees
    assert all(keys[id(m)] == signature.structure_key(m) for m in model.modules())
    memo = MetaMemo()
    records, error = tracer.record_calls(model, memo=memo)
    assert error is None and memo.hits >= 3  # layers 1..3 reuse layer 0's meta run
    for layer in layers:  # the skipped layers' children still have their inputs
        assert id(layer.self_attn.q_proj) in records and id(layer.mlp) in records
    fxrewrite.optimize(model)
    assert traces["Qwen3DecoderLayer"] == 1 and traces["Qwen3Attention"] == 1 and traces["Qwen3MLP"] == 1


def test_shape_and_attribute_differences_separate_instances():
    model = tiny_model("qwen3", num_hidden_layers=3)
    a, b, c = (layer.self_attn for layer in model.model.layers)
    assert signature.structure_key(a) == signature.structure_key(b)
    b.sliding_window = 4  # what a sliding-window layer of `layer_types` has
    c.q_proj = nn.Linear(32, 40, bias=False)  # another shape
    keys = {signature.structure_key(m) for m in (a, b, c)}
    assert len(keys) == 3
    c2 = copy.deepcopy(a)
    c2.k_proj.weight.requires_grad_(False)
    assert signature.structure_key(c2) != signature.structure_key(a)


class _IndexedBlock(nn.Module):
    """A layer whose forward branches on its index: the index must stay in the structure key."""

    def __init__(self, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x) * 2 if self.layer_idx == 0 else self.proj(x)


def test_layer_index_used_in_control_flow_stays_in_the_key():
    assert signature.structure_key(_IndexedBlock(0)) != signature.structure_key(_IndexedBlock(1))


class _Recorded(nn.Module):
    """Keeps its constructor's arguments as `kwargs` (PEFT's LoRA layers do, with their own module name)."""

    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs
        self.proj = nn.Linear(4, 4)


class _RecordedReader(_Recorded):
    def forward(self, x):
        return self.proj(x) * self.kwargs["scale"]


class _RecordedOnly(_Recorded):
    def forward(self, x):
        return self.proj(x)


def test_a_record_of_constructor_arguments_counts_only_when_a_method_reads_it():
    a, b = _RecordedOnly(target_name="layers.0.q", scale=2), _RecordedOnly(target_name="layers.1.q", scale=3)
    assert signature.structure_key(a) == signature.structure_key(b)  # only __init__ names `kwargs`
    a, b = _RecordedReader(target_name="layers.0.q", scale=2), _RecordedReader(target_name="layers.0.q", scale=3)
    assert signature.structure_key(a) != signature.structure_key(b)  # forward reads it: kept
    assert "attribute kwargs" in signature.difference(a, b)


class _Adapter(nn.Module):
    """A LoRA-style wrapper: base linear plus a low-rank update (another child class than nn.Linear)."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x))


def _entry_reasons(model, cls):
    return fxrewrite.explain(model).classes[cls].skipped


def test_adapter_on_one_layer_is_judged_on_its_own(traces):
    stock = tiny_model("llama", num_hidden_layers=3)
    attn = stock.model.layers[1].self_attn
    attn.q_proj = _Adapter(attn.q_proj)
    fused = fxrewrite.optimize(copy.deepcopy(stock))
    assert traces["LlamaAttention"] == 2
    layers = fused.model.layers
    assert hasattr(layers[0].self_attn, "qkv_proj") and hasattr(layers[2].self_attn, "qkv_proj")
    assert type(layers[1].self_attn.q_proj) is _Adapter and not hasattr(layers[1].self_attn, "qkv_proj")
    reasons = _entry_reasons(fused, "LlamaAttention")
    assert ("qkv", "[model.layers.1.self_attn] not found in this instance's graph, unlike "
                   "[model.layers.0.self_attn and 1 more]: q_proj is _Adapter, not Linear") in reasons
    applied = fxrewrite.explain(fused).classes["LlamaAttention"].applied["qkv"]
    assert list(applied.values()) == [2]
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(fused, ids), _logits(stock, ids), rtol=1e-5, atol=1e-5)


def test_hook_on_a_child_of_one_layer_keeps_that_layer_unfused(traces):
    stock = tiny_model("llama", num_hidden_layers=3)
    fired = []
    fused = copy.deepcopy(stock)
    fused.model.layers[2].self_attn.k_proj.register_forward_hook(lambda m, i, o: fired.append(o.shape))
    fxrewrite.optimize(fused)
    assert fired == []  # optimize's meta runs do not call users' hooks (review F3)
    assert traces["LlamaAttention"] == 2 and traces["LlamaDecoderLayer"] == 2
    assert not hasattr(fused.model.layers[2].self_attn, "qkv_proj")
    assert hasattr(fused.model.layers[0].self_attn, "qkv_proj")
    reasons = dict(_entry_reasons(fused, "LlamaAttention"))
    assert reasons["qkv"] == ("[model.layers.2.self_attn] forward/backward hooks on child 'k_proj' would be lost "
                              "by the fusion; left as it is")
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(fused, ids), _logits(stock, ids), rtol=1e-5, atol=1e-5)
    assert fired == [torch.Size([1, 6, 16])]  # the hook still runs


class _MLP(nn.Module):
    def __init__(self, hidden=8, inter=12):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, inter), nn.Linear(hidden, inter)
        self.down_proj, self.act_fn = nn.Linear(inter, hidden), nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _Stack(nn.Module):
    def __init__(self, mlps):
        super().__init__()
        self.mlps = nn.ModuleList(mlps)

    def forward(self, x):
        for mlp in self.mlps:
            x = x + mlp(x)
        return x


def test_monkey_patched_forward_on_one_instance_is_kept(traces):
    torch.manual_seed(0)
    stack = _Stack([_MLP(), _MLP(), _MLP()])
    patched = stack.mlps[1]
    patched.forward = lambda x: patched.down_proj(patched.up_proj(x))  # one instance runs other code
    x = torch.randn(2, 3, 8)
    want = stack(x)
    fxrewrite.optimize(stack, example_inputs=((x,), {}))
    assert traces["_MLP"] == 2
    assert hasattr(stack.mlps[0], "gate_up_proj") and hasattr(stack.mlps[2], "gate_up_proj")
    assert hasattr(patched, "gate_proj") and not hasattr(patched, "gate_up_proj")
    (reason,) = [r for p, r in _entry_reasons(stack, "_MLP") if p == "glu"]
    assert reason.startswith("[mlps.1] the forward of this _MLP instance is replaced (")
    torch.testing.assert_close(stack(x), want, rtol=1e-6, atol=1e-6)


def test_different_shapes_are_traced_and_fused_each(traces):
    torch.manual_seed(0)
    stack = _Stack([_MLP(8, 12), _MLP(8, 20), _MLP(8, 12)])
    x = torch.randn(2, 3, 8)
    want = stack(x)
    fxrewrite.optimize(stack, example_inputs=((x,), {}))
    assert traces["_MLP"] == 2
    assert all(hasattr(m, "gate_up_proj") for m in stack.mlps)
    assert stack.mlps[1].gate_up_proj.weight.shape == (40, 8)
    assert list(fxrewrite.explain(stack).classes["_MLP"].applied["glu"].values()) == [3]
    torch.testing.assert_close(stack(x), want, rtol=1e-6, atol=1e-6)


def _no_cache(monkeypatch):
    """Every module its own structure: each instance traced alone, no meta run reused."""
    def unique(module):
        return ("unique", id(module))
    for mod in (compiler, compiler.signature):
        monkeypatch.setattr(mod, "structure_key", unique)
    monkeypatch.setattr("fxrewrite.meta_memo.structure_key", unique)
    monkeypatch.setattr(tracer, "structure_keys", lambda root: {id(m): unique(m) for m in root.modules()})


def _grads(model, ids):
    model.zero_grad()
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), to_hf_names(model, {n: p.grad for n, p in model.named_parameters()})


def test_cached_optimize_equals_uncached_and_transformers(traces, monkeypatch):
    """Qwen3, 4 layers, sliding-window and full attention layers mixed (`layer_types`): with the cache, the
    two kinds of attention are traced apart; logits and gradients equal transformers' (float32, 1e-5) and,
    bit for bit, those of an optimize without the cache."""
    kinds = ["full_attention", "sliding_attention"] * 2
    stock = tiny_model("qwen3", num_hidden_layers=4, layer_types=kinds, use_sliding_window=True, sliding_window=3)
    stock.config._attn_implementation = "eager"  # sliding window through the mask on a CPU
    cached = fxrewrite.optimize(copy.deepcopy(stock))
    assert traces["Qwen3Attention"] == 2 and traces["Qwen3DecoderLayer"] == 2
    traces.clear()
    with monkeypatch.context() as m:
        _no_cache(m)
        uncached = fxrewrite.optimize(copy.deepcopy(stock))
    assert traces["Qwen3Attention"] == 4 and traces["Qwen3DecoderLayer"] == 4
    assert fxrewrite.explain(cached).applied_patterns() == fxrewrite.explain(uncached).applied_patterns()
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    want = _logits(stock, ids)
    torch.testing.assert_close(_logits(cached, ids), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_logits(cached, ids), _logits(uncached, ids), rtol=0, atol=0)
    (loss_s, g_s), (loss_c, g_c), (loss_u, g_u) = (_grads(m, ids) for m in (stock, cached, uncached))
    torch.testing.assert_close(loss_c, loss_s, rtol=1e-6, atol=1e-6)
    assert set(g_c) == set(g_s) == set(g_u)
    for name, g in g_s.items():
        torch.testing.assert_close(g_c[name], g, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(g_c[name], g_u[name], rtol=0, atol=0, msg=name)


def test_fused_away_weights_are_freed_as_the_rewrite_goes(monkeypatch):
    """The recorded calls and the meta memo hold modules weakly: each layer's old q/k/v weights are freed
    when its fused layer is built (Qwen3-4B: otherwise 4.7 GB more at the peak)."""
    model = tiny_model("llama", num_hidden_layers=3)
    refs = [weakref.ref(layer.self_attn.q_proj.weight) for layer in model.model.layers]
    alive = []
    real = compiler._build_all

    def build(module, *args):
        built = real(module, *args)
        if type(module).__name__ == "LlamaAttention":
            alive.append(sum(r() is not None for r in refs))
        return built

    monkeypatch.setattr(compiler, "_build_all", build)
    fxrewrite.optimize(model)
    assert alive == [2, 1, 0]
