"""Users' hooks after optimize on the GPU's Triton training path (the CPU suite runs it in the interpreter): a forward
put on down_proj's instance and backward hooks on down_proj and on a residual-folded norm run, with stock's loss
and gradients (float32)."""

from __future__ import annotations

import copy
import types

import pytest
import torch

import fxrewrite
from tests.e2e.tiny_models import tiny_model

pytestmark = pytest.mark.gpu


def _halve_forward(module):
    def forward(self, x):
        return type(self).forward(self, x) * 0.5
    module.forward = types.MethodType(forward, module)


@pytest.mark.parametrize("case", ["down_forward", "down_backward", "norm_backward", "norm_backward_pre"])
def test_hooks_after_optimize_on_the_triton_training_path(case):
    stock = tiny_model("llama").cuda().train()
    model = fxrewrite.optimize(copy.deepcopy(stock)).train()
    for m in (stock, model):
        layer = m.model.layers[1]
        if case == "down_forward":
            _halve_forward(layer.mlp.down_proj)
        elif case == "down_backward":
            layer.mlp.down_proj.register_full_backward_hook(lambda mod, gin, gout: (gin[0] * 0.5,))
        elif case == "norm_backward":
            layer.post_attention_layernorm.register_full_backward_hook(lambda mod, gin, gout: (gin[0] * 0.5,))
        else:
            layer.post_attention_layernorm.register_full_backward_pre_hook(lambda mod, gout: (gout[0] * 3,))
    ids = torch.tensor([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]], device="cuda")
    loss, want = model(ids, labels=ids).loss, stock(ids, labels=ids).loss
    loss.backward(), want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-5)
    for name in ("embed_tokens", "layers.0.self_attn.o_proj", "layers.1.post_attention_layernorm", "layers.1.mlp.down_proj"):
        torch.testing.assert_close(model.model.get_submodule(name).weight.grad,
                                   stock.model.get_submodule(name).weight.grad, rtol=1e-4, atol=1e-5, msg=name)
