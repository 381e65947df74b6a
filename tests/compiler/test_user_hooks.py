"""Users' module hooks and optimize (review F3): optimize's own meta runs and probes never call them, they are
back exactly afterwards (also after an error), they run on the real forward of every module that is still
there, and a hooked module that a fusion would delete or replace stays unfused, with the reason in the report."""

import copy

import pytest
import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

import fxrewrite
from fxrewrite import user_hooks
from fxrewrite.layers.input_norm import _fused_qkv

from tests.e2e.tiny_models import tiny_model


def _hooks(model, calls):
    """Hooks a user might have: one reads a value (``.item()``: raises on a meta tensor), one takes kwargs, one
    sits on a module a pattern replaces (the final norm), one on an activation the GLU probe calls."""
    layers = model.model.layers

    def read_value(module, args, output):
        calls.append(("mlp", output.device.type))
        output.sum().item()

    return [layers[0].mlp.register_forward_hook(read_value),
            layers[1].self_attn.register_forward_pre_hook(
                lambda m, args, kwargs: calls.append(("attn", kwargs["hidden_states"].device.type)), with_kwargs=True),
            model.model.norm.register_forward_pre_hook(lambda m, args: calls.append(("norm", args[0].device.type))),
            layers[1].mlp.act_fn.register_forward_hook(lambda m, args, out: calls.append(("act", out.device.type))),
            layers[0].self_attn.register_full_backward_hook(lambda m, gin, gout: calls.append(("backward", "cpu")))]


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_hooks_do_not_run_inside_optimize_and_run_after_it():
    stock = tiny_model("llama")
    fused, calls, everywhere = copy.deepcopy(stock), [], []
    _hooks(fused, calls)
    handles = [register_module_forward_hook(lambda m, args, out: everywhere.append(type(m).__name__)),
               register_module_forward_pre_hook(lambda m, args: everywhere.append(type(m).__name__))]
    try:
        fxrewrite.optimize(fused)
        assert calls == [] and everywhere == []  # before: every hook saw meta tensors, and .item() stopped the run
        report = fxrewrite.explain(fused)
        assert not any("meta run stopped early" in note for note in report.notes)
        assert "2 global module hook(s)" in " ".join(report.notes)
        ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
        out = fused(ids).logits
        out.sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    assert set(calls) == {
        ("mlp", "cpu"), ("attn", "cpu"), ("norm", "cpu"), ("act", "cpu"), ("backward", "cpu")}
    assert "RMSNorm" in everywhere and "LlamaAttention" in everywhere
    layers = fused.model.layers
    assert all(hasattr(layer.self_attn, "qkv_proj") for layer in layers)  # a hook on a module does not stop
    assert hasattr(layers[0].mlp, "gate_up_proj")  # its forward's rewrite: hooks run around the new forward
    assert not hasattr(layers[1].mlp, "gate_up_proj")  # its hooked act_fn would be fused away
    assert type(fused.model.norm).__name__ == "LlamaRMSNorm"  # a hooked module is not replaced
    reasons = [r for entry in fxrewrite.explain(fused).classes.values() for _, r in entry.skipped]
    assert "[model.norm] forward/backward hooks on the module itself would be lost by the fusion; left as it is" \
        in reasons
    assert "[model.layers.1.mlp] forward/backward hooks on child 'act_fn' would be lost by the fusion; " \
        "left as it is" in reasons
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)


def test_transformers_output_recorders_are_not_users_hooks():
    """transformers' output recorders, installed by a call asking for hidden states before optimize, block no fusion
    (they did: the input norm's fold into self_attn, "hooks on child 'self_attn'"); they are removed with the
    model's mark, so transformers installs them again on the rewritten modules, and the hidden states equal stock's.
    A user's hook beside them stays."""
    stock = tiny_model("qwen3")
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    stock(ids, output_hidden_states=True)
    assert stock.model.layers[0].self_attn._forward_hooks
    fused = copy.deepcopy(stock)
    mine = fused.model.layers[1].self_attn.register_forward_hook(lambda module, args, out: None)
    fxrewrite.optimize(fused)
    skipped = dict(fxrewrite.explain(fused).classes["Qwen3DecoderLayer"].skipped)
    assert skipped == {"input_norm": "[model.layers.1] forward/backward hooks on child 'self_attn' would be lost by "
                                     "the fusion; left as it is"}
    assert list(fused.model.layers[1].self_attn._forward_hooks) == [mine.id]
    got, want = fused(ids, output_hidden_states=True), stock(ids, output_hidden_states=True)
    assert len(got.hidden_states) == len(want.hidden_states) == 3
    for a, b in zip(got.hidden_states, want.hidden_states):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert user_hooks.drop_output_recorders(fused) == 4  # installed again: both layers and their attentions


def test_idle_output_recorders_leave_the_folds_on():
    """After one call asking for hidden states (transformers installs its recorders on the rewritten attentions and
    layers), later inference calls still take the input norm's fold: a recorder does nothing while no call records
    (they had turned the fold off for good); a user's hook still turns it off."""
    stock = tiny_model("qwen3")
    fused = fxrewrite.optimize(copy.deepcopy(stock))
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    got, want = fused(ids, output_hidden_states=True), stock(ids, output_hidden_states=True)
    for a, b in zip(got.hidden_states, want.hidden_states):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    layer = fused.model.layers[0]
    assert layer.self_attn._forward_hooks  # transformers' recorder
    x = torch.randn(2, 7, stock.config.hidden_size)
    with torch.no_grad():
        assert _fused_qkv(layer.input_layernorm, layer.self_attn, x) is layer.self_attn.qkv_proj
        torch.testing.assert_close(fused(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)
    mine = layer.self_attn.register_forward_hook(lambda module, args, out: None)
    with torch.no_grad():
        assert _fused_qkv(layer.input_layernorm, layer.self_attn, x) is None  # a user's hook still turns it off
    mine.remove()


def test_suspended_puts_every_hook_back_exactly_even_on_error():
    model = tiny_model("llama", num_hidden_layers=1)
    mlp, calls = model.model.layers[0].mlp, []
    first = mlp.register_forward_hook(lambda m, a, o: calls.append("first"))
    mlp.register_forward_pre_hook(lambda m, a, k: calls.append("kwargs"), with_kwargs=True)
    mlp.register_forward_hook(lambda m, a, o: calls.append("always"), always_call=True)
    everywhere = register_module_forward_hook(lambda m, a, o: calls.append("global") if m is mlp else None)
    dicts = {name: (mlp.__dict__[name], list(mlp.__dict__[name].items()))
             for name in ("_forward_hooks", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
                          "_forward_hooks_always_called")}
    x = torch.randn(1, 2, 32)
    try:
        with pytest.raises(RuntimeError, match="inside"), user_hooks.suspended(model):
            mlp(x)
            added = mlp.register_forward_hook(lambda m, a, o: calls.append("added"))
            assert calls == []
            raise RuntimeError("inside")
        for name, (d, items) in dicts.items():
            assert mlp.__dict__[name] is d and list(d.items())[:len(items)] == items, name
        mlp(x)
        assert calls == ["kwargs", "global", "first", "always", "added"]  # torch runs global hooks first
        first.remove()
        added.remove()
        calls.clear()
        mlp(x)
        assert calls == ["kwargs", "global", "always"]  # the handles still remove their own hook
    finally:
        everywhere.remove()


def test_a_hook_on_a_fused_away_projection_warns_that_it_never_runs():
    """After optimize, q_proj is a placeholder inside qkv_proj's rows: a hook put on it would silently record nothing
    (a fresh user's finding). A warning, not an error: tools that hook every module (DeepSpeed ZeRO-3) keep working."""
    model = fxrewrite.optimize(tiny_model("llama"))
    q_proj = model.model.layers[0].self_attn.q_proj
    for register in (q_proj.register_forward_hook, q_proj.register_forward_pre_hook,
                     q_proj.register_full_backward_hook, q_proj.register_full_backward_pre_hook):
        with pytest.warns(UserWarning, match="'q_proj' never runs: it was fused into 'qkv_proj'"):
            register(lambda *args: None).remove()


def test_hooks_added_after_optimize_on_norms_whose_calls_changed_are_warned():
    """fresh-user report: a hook registered after optimize on post_attention_layernorm got (normed, residual) and two
    inputs (the residual add folded into the norm) and its `o * 2` broke the layer with a bare unpacking error; one on
    q_norm saw another layout. Now registering a hook on q_norm warns, naming the new call form (hooks on the
    residual-folded norm see transformers' call, the next tests); a norm the rewrite calls
    as transformers did (the final norm) registers silently; a hooked q_norm runs its own forward (not skipped by the
    fused kernel) and the logits stay stock's when the hook changes nothing."""
    import warnings

    stock = tiny_model("qwen3").eval()
    model = fxrewrite.optimize(copy.deepcopy(stock)).eval()
    layer = model.model.layers[1]
    seen = []
    with pytest.warns(UserWarning, match=r"qk_norm_rope on \[batch, heads, tokens, head_dim\]"):
        layer.self_attn.q_norm.register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.model.norm.register_forward_pre_hook(lambda m, args: None)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)
    assert len(seen) == 1 and seen[0][2] == 3, seen  # [batch, heads, tokens, head_dim]


def test_a_hook_on_the_activation_after_optimize_runs_on_the_gate_half():
    """The activation module (act_fn) stays on the MLP after its gate/up fusion, which computes silu(gate) * up in
    one kernel: a hook put on it later used to never run, silently. Now the call takes act_fn(gate) * up through it,
    in inference and training alike (also in the decoder layer's norm/MLP fold), with stock's logits and gradients."""
    stock = tiny_model("llama")
    model = fxrewrite.optimize(copy.deepcopy(stock))
    mlp = model.model.layers[1].mlp
    seen = []
    handle = mlp.act_fn.register_forward_hook(
        lambda m, args, out: seen.append((tuple(args[0].shape), out.requires_grad)))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits, stock.eval()(ids).logits, rtol=1e-5, atol=1e-5)
    assert seen == [((1, 4, stock.config.intermediate_size), False)]
    model.train(), stock.train()
    model(ids, labels=ids).loss.backward()
    stock(ids, labels=ids).loss.backward()
    assert seen[1:] == [((1, 4, stock.config.intermediate_size), True)]
    torch.testing.assert_close(mlp.gate_up_proj.weight.grad,
                               torch.cat([stock.model.layers[1].mlp.gate_proj.weight.grad,
                                          stock.model.layers[1].mlp.up_proj.weight.grad]), rtol=1e-5, atol=1e-6)
    handle.remove()
    with torch.no_grad():
        model.eval()(ids)
    assert len(seen) == 2  # removed: the fused kernel again


def test_an_activation_module_put_in_place_after_optimize_runs():
    """``mlp.act_fn = GELU`` after optimize: the fused SiLU-and-mul had ignored it, silently (a fresh user's find);
    now the new module runs on the gate half, in the decoder layer's fold and in training, with stock's numbers."""
    from transformers.activations import ACT2FN

    stock = tiny_model("llama")
    model = fxrewrite.optimize(copy.deepcopy(stock))
    for m in (stock, model):
        m.model.layers[0].mlp.act_fn = ACT2FN["gelu"]
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits, stock.eval()(ids).logits, rtol=1e-5, atol=1e-5)
    model.train()(ids, labels=ids).loss.backward()
    stock.train()(ids, labels=ids).loss.backward()
    torch.testing.assert_close(model.model.layers[0].mlp.down_proj.weight.grad,
                               stock.model.layers[0].mlp.down_proj.weight.grad, rtol=1e-5, atol=1e-6)


def test_a_hook_on_the_lm_head_after_optimize_runs_in_a_training_call():
    """A training call with labels fuses lm_head into the loss (no logits made); a hook on lm_head registered after
    optimize used to be skipped there. Now that call keeps the stock path: the hook sees the logits, the loss is
    stock's."""
    stock = tiny_model("qwen3").train()
    model = fxrewrite.optimize(copy.deepcopy(stock)).train()
    seen = []
    model.lm_head.register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    out = model(ids, labels=ids)
    assert seen == [(1, 5, stock.config.vocab_size)] and out.logits is not None
    torch.testing.assert_close(out.loss, stock(ids, labels=ids).loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("triton", [False, True])
def test_forwards_and_backward_hooks_put_on_fused_over_modules_after_optimize_run(triton, monkeypatch):
    """A fresh user's finds: a ``forward`` put on the instance of ``lm_head`` or ``mlp.act_fn`` after optimize (as
    ``module.forward = ...`` or accelerate's ``add_hook_to_module`` do) was skipped by a training call, silently
    (the fused loss and SiLU-and-mul never call them); with the Triton kernels (a GPU's path, here the interpreter)
    so were such a forward and a full backward hook on ``down_proj``, which the activation + down Function bypasses.
    Each now runs, with stock's loss and gradients."""
    import types

    if triton:
        from tests.triton_cpu import require_interpreter

        require_interpreter()
        monkeypatch.setenv("FXREWRITE_TRITON", "1")

    def halve_forward(module, calls):
        def forward(self, x):
            calls.append(1)
            return type(self).forward(self, x) * 0.5
        module.forward = types.MethodType(forward, module)

    def halve_input_grad(module, calls):
        module.register_full_backward_hook(lambda m, gin, gout: (calls.append(1), (gin[0] * 0.5,))[1])

    cases = [(lambda m: m.lm_head, halve_forward), (lambda m: m.model.layers[0].mlp.act_fn, halve_forward),
             (lambda m: m.model.layers[1].mlp.down_proj, halve_forward),
             (lambda m: m.model.layers[1].mlp.down_proj, halve_input_grad)]
    ids = torch.tensor([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]])
    for where, put in cases:
        stock = tiny_model("llama").train()
        model = fxrewrite.optimize(copy.deepcopy(stock)).train()
        calls = {"stock": [], "fused": []}
        put(where(stock), calls["stock"])
        put(where(model), calls["fused"])
        loss, want = model(ids, labels=ids).loss, stock(ids, labels=ids).loss
        loss.backward(), want.backward()
        assert len(calls["fused"]) == len(calls["stock"]) == 1
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        for name in ("embed_tokens", "layers.0.self_attn.o_proj", "layers.1.mlp.down_proj"):
            torch.testing.assert_close(model.model.get_submodule(name).weight.grad,
                                       stock.model.get_submodule(name).weight.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_forward_hooks_on_a_residual_folded_norm_see_transformers_call(arch):
    """A norm the residual fold calls as norm(x, residual): forward (pre-)hooks registered after optimize see
    transformers' call, norm(x + residual) -> normed (a fresh user's find: `args[0] + 1` changed the attention
    output before the add, silently; `out * 2` and `out.clamp(...)` broke the layer), in inference (the decode
    fold) and training, with stock's logits and gradients; no warning for them."""
    import warnings

    hooks = [("pre", lambda m, a: (a[0] + 1.0,) + tuple(a[1:])), ("pre", lambda m, a: a[0] * 0.5),
             ("fwd", lambda m, a, o: o * 2), ("fwd", lambda m, a, o: o.clamp(-1, 1) + a[0] * 0.01)]
    stock = tiny_model(arch)
    model = fxrewrite.optimize(copy.deepcopy(stock))
    for m in (stock, model):
        norm = m.model.layers[0].post_attention_layernorm
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for kind, hook in hooks:
                (norm.register_forward_pre_hook if kind == "pre" else norm.register_forward_hook)(hook)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits, stock.eval()(ids).logits, rtol=1e-5, atol=1e-5)
    model.train()(ids, labels=ids).loss.backward()
    stock.train()(ids, labels=ids).loss.backward()
    torch.testing.assert_close(model.model.norm.weight.grad, stock.model.norm.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_backward_and_with_kwargs_hooks_on_a_residual_folded_norm_see_transformers_call(arch):
    """Backward (pre-)hooks and with_kwargs forward (pre-)hooks on a norm the residual fold calls see transformers'
    call too: the gradients of norm(x + residual)'s input and normed output (a fresh user's find: a backward hook
    halving its input gradient also halved the residual stream's, gradients 50% off, with a warning only); each
    runs once a call, with stock's values, and changes them as in stock; no warning."""
    import warnings

    def hooks(seen):
        def bwd(m, gin, gout):
            seen.append(("bwd", gin[0].clone(), gout[0].clone(), len(gin), len(gout)))
            return (gin[0] * 0.5,)

        def bwd_pre(m, gout):
            seen.append(("bwd_pre", gout[0].clone(), len(gout)))
            return (gout[0] * 3,)

        def pre_kw(m, args, kwargs):
            seen.append(("pre_kw", args[0].clone(), len(args), dict(kwargs)))
            return (args[0] * 2,), kwargs

        def fwd_kw(m, args, kwargs, out):
            seen.append(("fwd_kw", args[0].clone(), out.clone()))
            return out - 0.25

        return [("bwd", bwd), ("bwd_pre", bwd_pre), ("pre_kw", pre_kw), ("fwd_kw", fwd_kw)]

    stock = tiny_model(arch)
    model = fxrewrite.optimize(copy.deepcopy(stock))
    seen = {"stock": [], "fused": []}
    for key, m in (("stock", stock), ("fused", model)):
        norm = m.model.layers[0].post_attention_layernorm
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for kind, hook in hooks(seen[key]):
                register = {"bwd": norm.register_full_backward_hook, "bwd_pre": norm.register_full_backward_pre_hook,
                            "pre_kw": lambda h: norm.register_forward_pre_hook(h, with_kwargs=True),
                            "fwd_kw": lambda h: norm.register_forward_hook(h, with_kwargs=True)}[kind]
                register(hook)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits, stock.eval()(ids).logits, rtol=1e-5, atol=1e-5)
    seen["stock"].clear(), seen["fused"].clear()
    model.train()(ids, labels=ids).loss.backward()
    stock.train()(ids, labels=ids).loss.backward()
    assert [s[0] for s in seen["fused"]] == [s[0] for s in seen["stock"]] == ["pre_kw", "fwd_kw", "bwd_pre", "bwd"]
    for got, want in zip(seen["fused"], seen["stock"]):
        for a, b in zip(got[1:], want[1:]):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=got[0])
            else:
                assert a == b, got[0]
    for name in ("embed_tokens", "layers.0.self_attn.o_proj", "layers.0.post_attention_layernorm", "norm"):
        torch.testing.assert_close(model.model.get_submodule(name).weight.grad,
                                   stock.model.get_submodule(name).weight.grad, rtol=1e-5, atol=1e-6, msg=name)
