"""Pattern `moe`: the five families' blocks become FusedMoE, logits/gradients match stock, near misses refused."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T
from torch import nn

import fxrewrite
from fxrewrite.kernels.triton_utils import listen_launches
from fxrewrite.layers.fused_moe import FusedMoE
from tests.moe.conftest import LaunchNames, stock_eager, tiny_moe


def _moe_lines(model) -> list[str]:
    return [line for line in str(fxrewrite.explain(model)).splitlines() if "moe:" in line or "moe " in line]


def test_blocks_become_fused_moe_and_logits_match(family):
    model = tiny_moe(family)
    ref = stock_eager(copy.deepcopy(model))
    fxrewrite.optimize(model)
    fused = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(fused) == model.config.num_hidden_layers, fxrewrite.explain(model)
    if family == "qwen2_moe":
        assert fused[0].names.keys() == {"router", "experts", "shared", "shared_gate"}
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_report_names_the_fused_block_for_the_experts_inside_it():
    """The experts module goes with its block: its row names the FusedMoE that replaced the block, not the
    refusals of its own (moot) trace; with one block kept (a hook), the row says which share went and keeps them."""
    model = fxrewrite.optimize(tiny_moe("qwen3_moe"))
    entry = fxrewrite.explain(model).classes["Qwen3MoeExperts"]
    layers = model.config.num_hidden_layers
    assert entry.replaced_with == f"inside model.layers.0.mlp and {layers - 1} more, now FusedMoE" and not entry.skipped
    assert "(inside model.layers.0.mlp and" in str(fxrewrite.explain(model))
    assert not fxrewrite.explain(model).classes["Qwen3MoeSparseMoeBlock"].replaced_with
    # the router stays, a child of FusedMoE that reads its weight: its row says so instead of "-"
    router = fxrewrite.explain(model).classes["Qwen3MoeTopKRouter"]
    assert router.replaced_with == f"kept inside model.layers.0.mlp and {layers - 1} more, part of FusedMoE"
    partly = tiny_moe("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[1, 3])  # MoE layers 0 and 2
    partly.model.layers[0].mlp.gate.register_forward_hook(lambda module, args, out: None)  # keeps block 0 as it is
    report = fxrewrite.explain(fxrewrite.optimize(partly))
    entry = report.classes["Qwen3MoeExperts"]
    assert entry.replaced_with == "1 of 2 inside model.layers.2.mlp, now FusedMoE; the other 1 in model.layers.0.mlp" \
        and entry.skipped
    assert not report.classes["Qwen3MoeTopKRouter"].replaced_with  # one router is still the block's own
    assert dict(report.classes["Qwen3MoeSparseMoeBlock"].skipped)["moe"] == (  # the child, not "the module itself"
        "[model.layers.0.mlp] forward/backward hooks on child 'gate' would be lost by the fusion; left as it is")
    # the experts' activation stays where stock has it, a child of the fused experts (which refuse a changed one)
    assert type(partly.model.layers[2].mlp.experts).__name__ == "FusedExperts"
    assert type(partly.model.layers[2].mlp.experts.act_fn).__name__ == "SiLUActivation"


def test_the_replacing_holder_is_found_past_paths_the_replacement_lacks():
    from fxrewrite.compiler import _replacing_holder
    from fxrewrite.layers.layernorm import RMSNorm

    root = nn.Module()
    root.layer = nn.Module()
    root.layer.mlp = RMSNorm(4)  # an fxrewrite module without the old path's `experts` child
    assert _replacing_holder(root, "layer.mlp.experts.act_fn") == ("layer.mlp", root.layer.mlp)
    assert _replacing_holder(root, "layer.other.act_fn") is None


def test_report_compares_a_hooked_layer_with_the_nearest_group():
    """Dense and MoE layers, one MoE layer's post-attention norm hooked: the layer's row names the hook (against the
    other MoE layer), not the dense layers' different mlp."""
    model = tiny_moe("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[0])
    model.model.layers[2].post_attention_layernorm.register_forward_hook(lambda module, args, out: None)
    skipped = fxrewrite.explain(fxrewrite.optimize(model)).classes["Qwen3MoeDecoderLayer"].skipped
    assert skipped == [("residual_rms_norm", "[model.layers.2] not found in this instance's graph, unlike "
                        "[model.layers.1]: post_attention_layernorm has forward/backward hooks")]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_post_attention_norm_folds_into_the_router(triton_on, monkeypatch, family):
    """The decoder layer hands its residual add + post-attention RMSNorm to the FusedMoE block (one router launch
    at decode, as the native model), and its closing residual add (the experts' down kernel): the report says so,
    a no-grad forward takes that path (the norm-router kernel in the interpreter, at decode's token counts) and the
    logits still match transformers'."""
    model = tiny_moe(family)
    ref = stock_eager(copy.deepcopy(model))
    fxrewrite.optimize(model)
    layer = type(model.model.layers[0]).__name__
    report = fxrewrite.explain(model)
    assert list(report.classes[layer].applied["residual_rms_norm"]) == [
        "residual add + post_attention_layernorm -> mlp router + residual add"]
    assert ("+    hidden_states, residual = self.mlp(hidden_states, norm=self.post_attention_layernorm, "
            "residual=residual, add_residual=True)") in report.diff()
    launches = LaunchNames()
    ids = torch.randint(0, 96, (1, 1))
    with torch.no_grad(), listen_launches(launches):
        got = model(ids).logits
    assert launches.names.count("_norm_router_kernel") == model.config.num_hidden_layers, launches.names
    with torch.no_grad():
        torch.testing.assert_close(got, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_folded_block_under_autocast_matches_stock(triton_on):
    """A float32 model under CPU autocast to bf16 (the residual and the normed x then differ in dtype): the folded
    closing add promotes as transformers' add does, at decode's token count, on the Triton path (bf16 tolerance,
    widened: Triton's interpreter truncates float32 to bf16 where torch rounds)."""
    model = tiny_moe("qwen3_moe")
    ref = stock_eager(copy.deepcopy(model))
    fxrewrite.optimize(model)
    ids = torch.randint(3, 96, (2, 1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=5e-2, atol=5e-2)


def test_fused_moe_refuses_a_residual_without_its_norm():
    from fxrewrite.layers.fused_moe import FusedMoE

    block = next(m for m in fxrewrite.optimize(tiny_moe("qwen3_moe")).modules() if isinstance(m, FusedMoE))
    x = torch.randn(1, 2, 32)
    with pytest.raises(ValueError, match="residual and add_residual belong to the folded norm's call"):
        block(x, residual=x, add_residual=True)


def test_a_hooked_moe_block_keeps_its_plain_call():
    """A forward hook on one layer's MoE block: that block stays transformers' (moe refuses it) and its layer gets
    the residual add + norm fusion without the fold, so the hook sees the block's own call and output; the other
    layer is folded; logits still match transformers'."""
    model = tiny_moe("qwen3_moe")
    ref = stock_eager(copy.deepcopy(model))
    seen = []
    model.model.layers[1].mlp.register_forward_hook(lambda m, args, out: seen.append((len(args), out.shape)))
    fxrewrite.optimize(model)
    assert fxrewrite.explain(model).classes["Qwen3MoeDecoderLayer"].applied["residual_rms_norm"] == {
        "residual add + post_attention_layernorm -> mlp router + residual add": 1,
        "residual add + post_attention_layernorm": 1}
    ids = torch.randint(0, 96, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    assert seen == [(1, torch.Size([1, 5, 32]))]


def test_training_gradients_match_stock(family):
    model = tiny_moe(family).train()
    ref = stock_eager(copy.deepcopy(model))
    fxrewrite.optimize(model)
    ids = torch.randint(0, 96, (2, 6))
    model(ids, labels=ids).loss.backward()
    ref(ids, labels=ids).loss.backward()
    got = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        if name in got and p.grad is not None:
            torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)
    assert any("experts" in n for n in got)


def _older_than(version: str, bound: tuple[int, int]) -> bool:
    from packaging.version import Version

    return Version(version).release[:2] < bound


def _stock_outputs(ref, family: str, ids: torch.Tensor, **kwargs):
    """`ref(ids, labels=ids, **kwargs)`; a skip for the one known stock failure: GraniteMoE on older transformers
    (5.17; 5.25 works) returns the aux loss as an int 0 from load_balancing_loss_func and then calls
    `aux_loss.to(...)` with labels. Anything else fails."""
    try:
        return ref(ids, labels=ids, **kwargs)
    except AttributeError as e:
        if not (family == "granitemoe" and _older_than(T.__version__, (5, 25))
                and "'int' object has no attribute 'to'" in str(e)):
            raise
        pytest.skip(f"{family}: stock transformers {T.__version__} fails: {e}")


@pytest.mark.parametrize("train", [True, False])
def test_router_logits_and_aux_loss_match_stock(family, train):
    """output_router_logits=True on a fused model (the call's argument, or the config's set after optimize): the
    router modules run for transformers' recorder, so router_logits, aux_loss, the loss and (training) every
    gradient equal stock's; a call without it records nothing."""
    model = tiny_moe(family).train(train)
    ref = stock_eager(copy.deepcopy(model))
    fxrewrite.optimize(model)
    assert any(type(m).__name__ == "FusedMoE" for m in model.modules())
    ids = torch.randint(0, 96, (2, 6))
    with torch.set_grad_enabled(train):
        want = _stock_outputs(ref, family, ids, output_router_logits=True)
        got = model(ids, labels=ids, output_router_logits=True)
    assert len(got.router_logits) == len(want.router_logits) == 2
    for a, b in zip(got.router_logits, want.router_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    if train:
        _same_gradients(got.loss, model, want.loss, ref)
    model.config.output_router_logits = True
    assert model(ids, labels=ids).aux_loss is not None
    model.config.output_router_logits = False
    assert model(ids, labels=ids).aux_loss is None


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_router_logits_under_gradient_checkpointing_match_stock(family):
    """output_router_logits=True as the call's argument with gradient checkpointing (fresh user: a CheckpointError,
    "a different number of tensors was saved", since the recomputation runs without transformers' collector and
    skipped the router module's call): loss, aux loss and every gradient equal stock's."""
    model = tiny_moe(family).train()
    ref = stock_eager(copy.deepcopy(model))
    fxrewrite.optimize(model)
    ids = torch.randint(0, 96, (2, 6))
    for m in (model, ref):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    got, want = (m(ids, labels=ids, output_router_logits=True) for m in (model, ref))
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    _same_gradients(got.loss, model, want.loss, ref)


@pytest.mark.parametrize("when", ["config", "earlier call"])
def test_router_logits_asked_before_optimize_still_fuse(family, when):
    """A model loaded with output_router_logits=True (optimize's meta run then installs transformers' recorder hooks),
    or one that recorded outputs before optimize: those hooks are transformers' own, not the user's, so the blocks
    fuse (a fresh user's find: they were refused, "hooks on child 'gate'") and transformers puts them back on the
    rewritten modules; router logits, hidden states, the aux loss and every gradient equal stock's."""
    model = tiny_moe(family, output_router_logits=when == "config").train()
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(3))
    if when == "earlier call":
        with torch.no_grad():
            model(ids, output_router_logits=True, output_hidden_states=True)
    ref = stock_eager(copy.deepcopy(model))
    fxrewrite.optimize(model)
    fused = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(fused) == model.config.num_hidden_layers, fxrewrite.explain(model)
    want = _stock_outputs(ref, family, ids, output_router_logits=True, output_hidden_states=True)
    got = model(ids, labels=ids, output_router_logits=True, output_hidden_states=True)
    assert len(got.router_logits) == len(want.router_logits) == model.config.num_hidden_layers
    for a, b in [*zip(got.router_logits, want.router_logits), *zip(got.hidden_states, want.hidden_states)]:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6)
    _same_gradients(got.loss, model, want.loss, ref)


def _same_gradients(loss, model, ref_loss, ref) -> None:
    """Backward both losses; every gradient of `ref` (by name) equals `model`'s within float32 noise."""
    loss.backward()
    ref_loss.backward()
    params = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        if name in params and p.grad is not None:
            torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe"])
def test_state_dict_round_trips_through_save_pretrained(tmp_path, family):
    """The optimized model keeps transformers' state-dict keys, and what save_pretrained writes loads back into
    stock transformers with the same logits (each family's expert, router and shared-expert weights)."""
    model = tiny_moe(family)
    stock_keys = set(model.state_dict())
    fxrewrite.optimize(model)
    assert any(isinstance(m, FusedMoE) for m in model.modules()), fxrewrite.explain(model)  # the fused state dict
    assert set(model.state_dict()) == stock_keys
    model.save_pretrained(tmp_path)
    loaded = stock_eager(T.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval())
    ids = torch.randint(0, 96, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def _near_miss(monkeypatch, cls, forward, family="olmoe"):
    """A model whose `cls` blocks run `forward` instead: a subclass of our own (patching transformers'
    class itself would be a foreign patch, which optimize refuses outright)."""
    variant = type(f"NearMiss{cls.__name__}", (cls,), {"forward": forward})
    model = tiny_moe(family)
    for module in model.modules():
        if type(module) is cls:
            module.__class__ = variant
    fxrewrite.optimize(model)
    assert not any(isinstance(m, FusedMoE) for m in model.modules())
    return str(fxrewrite.explain(model))


def test_router_with_relu_scores_is_refused(monkeypatch):
    from transformers.models.olmoe import modeling_olmoe as mod

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        value, index = torch.topk(torch.relu(logits), self.top_k, dim=-1)
        return logits, value, index

    report = _near_miss(monkeypatch, mod.OlmoeTopKRouter, forward)
    assert "router scores are neither softmax nor sigmoid" in report


@pytest.mark.parametrize("topk, softmax, reason", [
    (lambda x, k: torch.topk(x, k, 0), lambda v: torch.softmax(v, -1), "router does not take topk over the experts"),
    (lambda x, k: torch.topk(x, k, -1, False), lambda v: torch.softmax(v, -1), "router does not take topk"),
    (lambda x, k: torch.topk(x, k, -1), lambda v: torch.softmax(v, 0), "routing softmax is not over the top-k"),
])
def test_granite_style_router_near_misses_are_refused(monkeypatch, topk, softmax, reason):
    """Granite-MoE routes by softmax over the top-k logits; positional dims and smallest-k are read, not assumed."""
    from transformers import GraniteMoeConfig
    from transformers.models.granitemoe import modeling_granitemoe as mod

    router = mod.GraniteMoeTopKRouter(GraniteMoeConfig(hidden_size=8, num_local_experts=4, num_experts_per_tok=2))
    index_first = not router(torch.randn(3, 8))[0].is_floating_point()  # transformers 5.17's order

    def forward(self, hidden_states):
        logits = torch.nn.functional.linear(hidden_states, self.weight).float()
        values, index = topk(logits, self.top_k)
        weights = softmax(values).type_as(hidden_states)
        return (index, weights, logits) if index_first else (logits, weights, index)

    assert reason in _near_miss(monkeypatch, mod.GraniteMoeTopKRouter, forward, "granitemoe")


def test_router_reading_a_transform_of_its_input_is_refused(monkeypatch):
    """The router's linear must read the router's input (rows of it): a scaled input routes differently."""
    from transformers.models.olmoe import modeling_olmoe as mod

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states * 3.0, self.weight)
        value, index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        return logits, value, index

    report = _near_miss(monkeypatch, mod.OlmoeTopKRouter, forward)
    assert "the router's linear does not read the router's input (it reads mul)" in report


def test_block_returning_router_logits_is_refused(monkeypatch):
    from transformers.models.olmoe import modeling_olmoe as mod

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        logits, w, ids = self.gate(x)
        return self.experts(x, ids, w).reshape(b, s, h) + logits.sum()

    report = _near_miss(monkeypatch, mod.OlmoeSparseMoeBlock, forward)
    assert "block output is not reshaped" in report or "computes more than" in report


def test_experts_with_gelu_are_refused(monkeypatch):
    model = tiny_moe("olmoe")
    for layer in model.model.layers:
        layer.mlp.experts.act_fn = nn.GELU()
    fxrewrite.optimize(model)
    assert not any(isinstance(m, FusedMoE) for m in model.modules())
    assert "experts do not compute" in str(fxrewrite.explain(model))


def test_block_with_jitter_is_refused():
    model = tiny_moe("mixtral", router_jitter_noise=0.1).train()
    fxrewrite.optimize(model)
    assert not any(isinstance(m, FusedMoE) for m in model.modules())
    report = str(fxrewrite.explain(model))
    assert "moe: experts input is not the block input" in report  # x is scaled by the jitter first


def test_an_experts_implementation_registered_by_the_user_is_not_replaced(monkeypatch):
    """transformers' experts registry: a user's function (here 3x transformers' batched_mm) is left to run, with
    the reason in the report; transformers' own batched_mm is fused (it computes what the eager probe proves)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, batched_mm_experts_forward

    def tripled(self, *args):
        return batched_mm_experts_forward(self, *args) * 3.0

    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS, "tripled", tripled)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    for impl, fused in (("tripled", False), ("batched_mm", True)):
        model = tiny_moe("qwen3_moe")
        model.config._experts_implementation = impl
        with torch.no_grad():
            want = model(ids).logits
        report = fxrewrite.explain(fxrewrite.optimize(model))
        assert any(isinstance(m, FusedMoE) for m in model.modules()) == fused
        if not fused:
            assert dict(report.classes["Qwen3MoeSparseMoeBlock"].skipped)["moe"] == (
                "experts_implementation 'tripled' runs tests.moe.test_moe_pattern.test_an_experts_implementation_"
                "registered_by_the_user_is_not_replaced.<locals>.tripled, not transformers' code")
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
