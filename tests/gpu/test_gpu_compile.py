"""torch.compile of the model forward (attention as the `fxrewrite::paged_attend` custom op)."""

from __future__ import annotations

import pytest
import torch


def test_custom_op_is_registered():
    import fxrewrite.runtime.worker.compilation  # noqa: F401

    assert hasattr(torch.ops.fxrewrite, "paged_attend")


def test_compilation_config_is_checked():
    from fxrewrite.runtime.worker.compilation import should_compile
    from fxrewrite.runtime.engine_config import EngineConfig

    assert not should_compile(EngineConfig(compilation_config=3), torch.device("cpu"))
    assert should_compile(EngineConfig(compilation_config=3), torch.device("cuda"))
    assert not should_compile(EngineConfig(compilation_config=3, enforce_eager=True), torch.device("cuda"))
    assert not should_compile(EngineConfig(), torch.device("cuda"))  # opt-in: compiling is slow for now
    with pytest.raises(ValueError, match="compilation_config"):
        should_compile(EngineConfig(compilation_config=7), torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("impl,fusion", [("native", True), ("transformers", True)])
def test_compiled_forward_matches_eager(make_llm, impl, fusion):
    from tests.gpu.conftest import decode_batch
    from fxrewrite.runtime.worker.forward_context import forward_context
    from fxrewrite.runtime.worker.memory_profiling import _dummy_metadata

    llm = make_llm(model_impl=impl, fusion=fusion, max_num_seqs=2, compilation_config=3)  # 2 buckets
    runner = llm.llm_engine.model_runner
    model = runner.model
    assert getattr(model, "_fxrewrite_compiled", False), "compile fell back to eager"
    eager_forward = type(model).forward.__get__(model)
    device = runner.device
    pos, meta, _ = _dummy_metadata(300, 120, runner.block_size, device)  # varlen prefill: 120, 120, 60
    meta.kv_caches = runner.kv_caches
    ids = torch.randint(0, 10000, (300,), device=device)
    with torch.inference_mode():
        with forward_context(meta):
            compiled = model(ids, pos)
            eager = eager_forward(ids, pos)
        ids, pos, meta = decode_batch(runner, 5)
        with forward_context(meta):
            compiled_decode = model(ids, pos)
            eager_decode = eager_forward(ids, pos)
    for a, b in ((compiled, eager), (compiled_decode, eager_decode)):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 1e-3, err
    assert getattr(model, "_fxrewrite_compiled", False)
