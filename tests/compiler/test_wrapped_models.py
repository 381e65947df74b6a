"""optimize() of a model that torch.compile, DDP, DataParallel, FSDP or accelerate already took over (review
F4): a TypeError that names the wrapper and the fix (optimize the plain model, then wrap it), and the model is
left untouched. Before, `optimize(torch.compile(model))` ran its meta run through dynamo, which failed: part of
the model was rewritten, the rest not, with no error; a DDP-wrapped model was fused behind DDP's back (the fused
parameters were not in DDP's buckets); an FSDP2-sharded one raised from inside FSDP."""

import pytest
import torch
import torch.distributed as dist

import fxrewrite

from tests.e2e.tiny_models import tiny_model


def _untouched(model):
    assert not hasattr(model, "_fxrewrite_report")
    assert all(hasattr(layer.self_attn, "q_proj") and not hasattr(layer.self_attn, "qkv_proj")
               for layer in model.model.layers)


def test_torch_compiled_model_is_refused_with_the_fix():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match=r"the model is a torch.compile'd module \(OptimizedModule around "
                                        r"LlamaForCausalLM\).*torch\.compile\(fxrewrite\.optimize\(model\), \.\.\.\)"):
        fxrewrite.optimize(torch.compile(model))
    _untouched(model)
    fused = torch.compile(fxrewrite.optimize(model))  # the order the error gives works
    assert hasattr(fused._orig_mod.model.layers[0].self_attn, "qkv_proj")


def test_compiled_submodules_are_refused():
    model = tiny_model("llama")
    model.model = torch.compile(model.model)
    with pytest.raises(TypeError, match=r"submodule 'model' \(OptimizedModule\) is a torch.compile'd module"):
        fxrewrite.optimize(model)
    model = tiny_model("llama")
    model.model.layers[1].compile()
    with pytest.raises(TypeError, match=r"submodule 'model.layers.1' \(LlamaDecoderLayer\) is compiled in place "
                                        r"with nn.Module.compile\(\).*call .compile\(\) on the optimized model"):
        fxrewrite.optimize(model)
    _untouched(model)


def test_data_parallel_wrappers_are_refused(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="the model is wrapped by DataParallel.*apply DataParallel to the optimized"):
        fxrewrite.optimize(torch.nn.DataParallel(model))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with pytest.raises(TypeError, match="the model is wrapped by DistributedDataParallel: call "
                                            r"fxrewrite.optimize\(model\) on the plain model first"):
            fxrewrite.optimize(torch.nn.parallel.DistributedDataParallel(model))
        _untouched(model)
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        with pytest.raises(TypeError, match=r"submodule 'model.layers.0' \(FSDPLlamaDecoderLayer\) is wrapped by "
                                            r"fully_shard \(FSDP2\)"):
            fxrewrite.optimize(model)
    finally:
        dist.destroy_process_group()


def test_accelerate_prepared_model_is_refused():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    model = tiny_model("llama")
    try:
        prepared = Accelerator(mixed_precision="bf16", cpu=True).prepare(model)
        with pytest.raises(TypeError, match=r"the model is prepared by accelerate's Accelerator.prepare .*"
                                            r"then accelerator.prepare the optimized model"):
            fxrewrite.optimize(prepared)
    finally:
        AcceleratorState._reset_state(True)  # a process-wide singleton: leave none behind for other tests
    _untouched(model)
